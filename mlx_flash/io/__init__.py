"""What the process asks of the OS: bytes off the disk and its own memory. Below the format; imports nothing of the
package but its errors.

    reader.py         the native pread pool's binding (batched, parallel, uncached reads) and aligned buffers
    checks.py         units checked against the checksums convert wrote, at their first read
    kernel_source.py  the kernel source files: where they are, split into named sections
    memory.py         the process's resident set, now and at its peak
"""
