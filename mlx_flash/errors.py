"""Typed errors raised by mlx_flash. Catch `FlashError` to catch them all."""


class FlashError(Exception):
    """Base class of every error mlx_flash raises on purpose."""


class FlashFormatError(FlashError):
    """A flash directory is missing, truncated, corrupted or of an unknown version."""


class SourceFileError(FlashFormatError):
    """A source file a flash directory reads its units from in place was moved, deleted, cut or changed."""


class UnsupportedArchitectureError(FlashError):
    """The model's architecture has no FFN adapter in mlx_flash."""


class BudgetError(FlashError):
    """The memory budget cannot hold what must stay resident."""


class BudgetWarning(UserWarning):
    """A memory budget above what the machine can give now."""


class SourceError(FlashError):
    """A conversion source (directory, hub id or GGUF file) cannot be read."""


class ReadError(FlashError, OSError):
    """A read from flash failed or came back short."""


class ChecksumError(ReadError, FlashFormatError):
    """Bytes read from flash are not what convert wrote (their checksum differs): the file is corrupted."""


class CapError(FlashError):
    """No memory cgroup can be created here, so a command cannot run under a hard memory cap."""


class DiskSpaceError(FlashError):
    """The disk a conversion writes to has not enough free space for it, or filled up while it wrote."""
