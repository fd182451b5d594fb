/*
 * mlx_flash._pread_pool: a native pread thread pool for streaming FFN bundles from flash.
 *
 * One Python call hands the pool a whole batch of reads (file offset, length, destination
 * offset) into one writable buffer-protocol object (numpy array, bytearray, evaluated
 * mx.array).  The batch is sorted by file offset, neighbouring requests that are contiguous
 * on disk (or separated by a gap of at most `max_gap` bytes) are merged into one preadv()
 * with one iovec per destination, requests longer than `max_request` are split, and the
 * resulting "runs" are executed by `threads` pthreads with the GIL released.
 *
 * Uncached I/O: O_DIRECT on Linux (offset, length and buffer address must be multiples of
 * `alignment`; a run that is not is read as the aligned superset into a per-thread aligned
 * bounce buffer and the wanted bytes are copied out), F_NOCACHE on macOS (no alignment rule;
 * that path compiles on Darwin but is not tested on the Linux CI machine).
 *
 * Errors (short read, EIO, EBADF, bad arguments, closed pool) raise
 * mlx_flash.errors.ReadError (an OSError) whose message carries the path, offset and length
 * and whose attributes `offset` and `length` are set.  Plain C11 + pthreads + the CPython
 * API; no numpy headers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#define MAX_IOV (IOV_MAX < 1024 ? IOV_MAX : 1024)
#define BOUNCE_BYTES ((int64_t)1 << 20) /* default per-thread bounce buffer for unaligned runs */
#define MAX_THREADS 1024

/* ------------------------------------------------------------------------------------ */
/* Batch representation                                                                  */

typedef struct {
    int64_t foff;    /* file offset */
    int64_t len;     /* bytes */
    char *dst;       /* destination address */
    int64_t idx;     /* index in the caller's arrays (for error messages) */
    int64_t ofoff, olen; /* the caller's request, before splitting */
} req_t;

typedef struct {
    int64_t foff, len;  /* file range covered by the run (gaps included) */
    uint32_t iov0, niov;
    uint32_t req0, nreq; /* requests (pieces) of the run, in the sorted request array */
    int aligned;        /* O_DIRECT-legal as is */
} run_t;

typedef struct batch {
    struct batch *qnext;
    req_t *reqs;
    size_t nreqs;
    run_t *runs;
    size_t nruns;
    struct iovec *iovs;
    char *gap_scratch; /* discarded bytes of filled gaps */
    atomic_size_t next; /* next run to claim */
    int active;         /* workers inside the batch (pool mutex) */
    int exhausted;      /* all runs claimed, removed from the queue (pool mutex) */
    int finished;       /* all claimed runs done (pool mutex) */
    pthread_cond_t cond;
    atomic_int failed;  /* first failure wins the CAS and fills err_* */
    int err_errno;      /* 0 for a short read (end of file) */
    int64_t err_off, err_len, err_idx, err_got; /* err_got: end-of-file offset of a short read */
    int64_t err_run_off, err_run_len;
    uint32_t err_run_nreq;
    int64_t bytes_requested;
    size_t nreads; /* non-empty requests as given by the caller */
} batch_t;

typedef struct pool pool_t;

typedef struct {
    pool_t *pool;
    pthread_t tid;
    char *bounce;
} worker_t;

struct pool {
    int fd;
    int direct;
    int64_t alignment;
    int64_t max_gap;
    int64_t max_request;
    int64_t bounce_bytes; /* each worker's bounce buffer: its memory, touched as unaligned runs need it */
    int nthreads;
    pid_t pid; /* the process that started the threads (a forked child has none) */
    worker_t *workers;
    int started;
    int inited; /* mutexes and condition variable initialised */
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    batch_t *head, *tail;
    int shutdown;
    pthread_mutex_t close_mu;
    int closed;
    atomic_llong bytes_read;      /* bytes transferred by syscalls (gaps, bounce supersets) */
    atomic_llong bytes_requested; /* bytes the callers asked for */
    atomic_llong requests;        /* read syscalls issued (after coalescing) */
    atomic_llong reads;           /* non-empty requests given by callers */
    atomic_llong batches;
    int inflight;       /* batches queued or being read (pool mutex) */
    int64_t busy_since; /* when inflight last went from 0 to 1, ns (pool mutex) */
    atomic_llong busy_ns; /* time with at least one batch in flight: bytes_read / busy_ns is the pool's
                             throughput while it had work, comparable with fio's */
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline int64_t align_down(int64_t x, int64_t a) { return x - (x % a); }
static inline int64_t align_up(int64_t x, int64_t a) { return align_down(x + a - 1, a); }
static inline int is_aligned_ptr(const void *p, int64_t a) { return ((uintptr_t)p % (uintptr_t)a) == 0; }

/* ------------------------------------------------------------------------------------ */
/* Error recording (worker side, no GIL)                                                 */

static void batch_fail(pool_t *p, batch_t *b, const run_t *r, int err, int64_t got_in_run) {
    int expected = 0;
    if (!atomic_compare_exchange_strong(&b->failed, &expected, 1)) return;
    /* Report the first request of the run that did not receive all its bytes. */
    const req_t *bad = &b->reqs[r->req0];
    const int64_t end = r->foff + got_in_run; /* for a short read: where the file ended */
    if (err == 0) {
        for (uint32_t k = 0; k < r->nreq; k++) {
            const req_t *q = &b->reqs[r->req0 + k];
            if (q->foff + q->len > end) {
                bad = q;
                break;
            }
        }
    }
    b->err_errno = err;
    b->err_off = bad->ofoff;
    b->err_len = bad->olen;
    b->err_idx = bad->idx;
    struct stat sb;
    b->err_got = (err == 0 && fstat(p->fd, &sb) == 0) ? (int64_t)sb.st_size : end; /* the true end of file */
    b->err_run_off = r->foff;
    b->err_run_len = r->len;
    b->err_run_nreq = r->nreq;
}

typedef struct {
    int64_t bytes, calls;
} wstats_t;

/* Read [off, off+len) with any alignment through the worker's aligned bounce buffer and
 * scatter it into iov[0..niov).  Iovecs whose base is `skip` (gap scratch) are not copied.
 * Returns 0, or -1 with *err (errno, 0 = end of file) and *got (bytes of the range served). */
static int read_bounce(pool_t *p, worker_t *w, int64_t off, int64_t len, struct iovec *iov, uint32_t niov,
                       const char *skip, wstats_t *st, int *err, int64_t *got) {
    const int64_t A = p->alignment;
    const int64_t start = align_down(off, A), end = align_up(off + len, A);
    uint32_t k = 0;    /* iovec cursor */
    size_t within = 0; /* bytes of iov[k] already filled */
    int64_t pos = start;
    *got = 0;
    if (!w->bounce) {
        void *mem = NULL;
        size_t al = (size_t)(A > 64 ? A : 64);
        if (posix_memalign(&mem, al, (size_t)p->bounce_bytes) != 0) {
            *err = ENOMEM;
            return -1;
        }
        w->bounce = mem;
    }
    while (pos < end) {
        int64_t chunk = end - pos < p->bounce_bytes ? end - pos : p->bounce_bytes;
        int64_t n = 0;
        while (n < chunk) {
            ssize_t m = pread(p->fd, w->bounce + n, (size_t)(chunk - n), (off_t)(pos + n));
            st->calls++;
            if (m < 0) {
                if (errno == EINTR) continue;
                *err = errno;
                return -1;
            }
            if (m == 0) break;
            st->bytes += m;
            n += m;
            if (A > 1 && (m % A) != 0) break; /* O_DIRECT: end of file inside a block */
        }
        /* copy the overlap of [pos, pos+n) and [off, off+len) */
        int64_t lo = pos > off ? pos : off;
        int64_t hi = pos + n < off + len ? pos + n : off + len;
        const char *src = w->bounce + (lo - pos);
        int64_t todo = hi > lo ? hi - lo : 0;
        while (todo > 0 && k < niov) {
            size_t room = iov[k].iov_len - within;
            size_t c = (size_t)todo < room ? (size_t)todo : room;
            if (iov[k].iov_base != skip) memcpy((char *)iov[k].iov_base + within, src, c);
            src += c;
            todo -= (int64_t)c;
            within += c;
            if (within == iov[k].iov_len) {
                k++;
                within = 0;
            }
        }
        *got = hi > off ? hi - off : 0;
        if (n < chunk) {
            if (pos + n < off + len) {
                *err = 0;
                return -1;
            }
            break;
        }
        pos += chunk;
    }
    return 0;
}

static void run_execute(pool_t *p, worker_t *w, batch_t *b, size_t i, wstats_t *st) {
    run_t *r = &b->runs[i];
    struct iovec *iov = b->iovs + r->iov0;
    uint32_t niov = r->niov;
    int64_t off = r->foff, left = r->len;
    int err = 0;
    if (atomic_load_explicit(&b->failed, memory_order_relaxed)) return; /* batch already failed */
    if (r->aligned || p->alignment == 1) {
        while (left > 0) {
            /* one destination: plain pread (what fio's psync engine issues) */
            ssize_t n = niov == 1 ? pread(p->fd, iov->iov_base, iov->iov_len, (off_t)off)
                                  : preadv(p->fd, iov, (int)niov, (off_t)off);
            st->calls++;
            if (n < 0) {
                if (errno == EINTR) continue;
                batch_fail(p, b, r, errno, off - r->foff);
                return;
            }
            if (n == 0) {
                batch_fail(p, b, r, 0, off - r->foff);
                return;
            }
            st->bytes += n;
            off += n;
            left -= n;
            /* advance the iovecs past n bytes (partial reads are rare: end of file, signals) */
            while (n > 0 && niov > 0) {
                if ((size_t)n >= iov->iov_len) {
                    n -= (ssize_t)iov->iov_len;
                    iov++;
                    niov--;
                } else {
                    iov->iov_base = (char *)iov->iov_base + n;
                    iov->iov_len -= (size_t)n;
                    n = 0;
                }
            }
            if (left > 0 && p->alignment > 1 && (off % p->alignment != 0 || !is_aligned_ptr(iov->iov_base, p->alignment) ||
                                          (int64_t)iov->iov_len % p->alignment != 0))
                break; /* finish the unaligned remainder through the bounce buffer */
        }
        if (left == 0) return;
    }
    int64_t got = 0;
    if (read_bounce(p, w, off, left, iov, niov, b->gap_scratch, st, &err, &got) != 0)
        batch_fail(p, b, r, err, off - r->foff + got);
}

/* ------------------------------------------------------------------------------------ */
/* Worker threads and the batch queue                                                    */

static void *worker_main(void *arg) {
    worker_t *w = arg;
    pool_t *p = w->pool;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->shutdown) pthread_cond_wait(&p->work_cv, &p->mu);
        batch_t *b = p->head;
        if (!b) break; /* shut down and the queue is drained */
        b->active++;
        pthread_mutex_unlock(&p->mu);
        wstats_t st = {0, 0};
        for (;;) {
            size_t i = atomic_fetch_add(&b->next, 1);
            if (i >= b->nruns) break;
            run_execute(p, w, b, i, &st);
        }
        atomic_fetch_add_explicit(&p->bytes_read, st.bytes, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->requests, st.calls, memory_order_relaxed);
        pthread_mutex_lock(&p->mu);
        if (!b->exhausted) { /* every run is claimed: b is still the queue head, unlink it */
            b->exhausted = 1;
            p->head = b->qnext;
            if (!p->head) p->tail = NULL;
        }
        if (--b->active == 0) {
            b->finished = 1;
            if (--p->inflight == 0) atomic_fetch_add_explicit(&p->busy_ns, now_ns() - p->busy_since, memory_order_relaxed);
            pthread_cond_broadcast(&b->cond);
        }
    }
    pthread_mutex_unlock(&p->mu);
    free(w->bounce);
    w->bounce = NULL;
    return NULL;
}

/* Returns 0, or -1 when the pool is shut down, -2 in a forked child (not queued). */
static int pool_enqueue(pool_t *p, batch_t *b) {
    if (getpid() != p->pid) return -2;
    pthread_mutex_lock(&p->mu);
    if (p->shutdown) {
        pthread_mutex_unlock(&p->mu);
        return -1;
    }
    atomic_fetch_add_explicit(&p->batches, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->reads, (long long)b->nreads, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->bytes_requested, b->bytes_requested, memory_order_relaxed);
    if (b->nruns == 0) {
        b->exhausted = 1;
        b->finished = 1;
        pthread_mutex_unlock(&p->mu);
        return 0;
    }
    if (p->inflight++ == 0) p->busy_since = now_ns();
    b->qnext = NULL;
    if (p->tail)
        p->tail->qnext = b;
    else
        p->head = b;
    p->tail = b;
    size_t wake = b->nruns < (size_t)p->nthreads ? b->nruns : (size_t)p->nthreads;
    if (wake == (size_t)p->nthreads)
        pthread_cond_broadcast(&p->work_cv);
    else
        for (size_t k = 0; k < wake; k++) pthread_cond_signal(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

static void batch_wait(pool_t *p, batch_t *b) {
    pthread_mutex_lock(&p->mu);
    while (!b->finished) pthread_cond_wait(&b->cond, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

static void batch_free(batch_t *b) {
    if (!b) return;
    pthread_cond_destroy(&b->cond);
    free(b->reqs);
    free(b->runs);
    free(b->iovs);
    free(b->gap_scratch);
    free(b);
}

static int req_cmp(const void *x, const void *y) {
    const req_t *a = x, *b = y;
    if (a->foff != b->foff) return a->foff < b->foff ? -1 : 1;
    if (a->idx != b->idx) return a->idx < b->idx ? -1 : 1;
    return a->dst < b->dst ? -1 : (a->dst > b->dst);
}

/* Sort, split and coalesce b->reqs into runs.  No GIL needed.  Returns 0 or ENOMEM. */
static int batch_plan(pool_t *p, batch_t *b, int64_t maxgap, int64_t maxreq) {
    const int64_t A = p->alignment;
    /* split long requests into pieces of max_request bytes (keeps pieces parallel) */
    if (maxreq > 0) {
        size_t extra = 0;
        for (size_t i = 0; i < b->nreqs; i++)
            if (b->reqs[i].len > maxreq) extra += (size_t)((b->reqs[i].len - 1) / maxreq);
        if (extra) {
            req_t *nr = malloc((b->nreqs + extra) * sizeof(req_t));
            if (!nr) return ENOMEM;
            size_t j = 0;
            for (size_t i = 0; i < b->nreqs; i++) {
                req_t q = b->reqs[i];
                for (int64_t d = 0; d < q.len; d += maxreq) {
                    nr[j] = q;
                    nr[j].foff = q.foff + d;
                    nr[j].dst = q.dst + d;
                    nr[j].len = q.len - d < maxreq ? q.len - d : maxreq;
                    j++;
                }
            }
            free(b->reqs);
            b->reqs = nr;
            b->nreqs = j;
        }
    }
    int sorted = 1;
    for (size_t i = 1; i < b->nreqs && sorted; i++) sorted = b->reqs[i - 1].foff <= b->reqs[i].foff;
    if (!sorted) qsort(b->reqs, b->nreqs, sizeof(req_t), req_cmp);

    b->runs = malloc((b->nreqs ? b->nreqs : 1) * sizeof(run_t));
    b->iovs = malloc((b->nreqs ? 2 * b->nreqs : 1) * sizeof(struct iovec));
    if (!b->runs || !b->iovs) return ENOMEM;
    int64_t biggest_gap = 0;
    size_t nruns = 0, niov = 0;
    run_t *cur = NULL;
    for (size_t i = 0; i < b->nreqs; i++) {
        req_t *q = &b->reqs[i];
        int64_t end = cur ? cur->foff + cur->len : 0;
        int64_t gap = cur ? q->foff - end : -1;
        if (cur && maxgap >= 0 && gap >= 0 && gap <= maxgap && cur->niov + (gap ? 2u : 1u) <= (uint32_t)MAX_IOV &&
            (maxreq <= 0 || cur->len + gap + q->len <= maxreq)) {
            if (gap) {
                b->iovs[niov].iov_base = NULL; /* patched to the gap scratch below */
                b->iovs[niov].iov_len = (size_t)gap;
                niov++;
                cur->niov++;
                if (gap > biggest_gap) biggest_gap = gap;
            }
        } else {
            cur = &b->runs[nruns++];
            cur->foff = q->foff;
            cur->len = 0;
            cur->iov0 = (uint32_t)niov;
            cur->niov = 0;
            cur->req0 = (uint32_t)i;
            cur->nreq = 0;
            cur->aligned = (q->foff % A) == 0;
            gap = 0;
        }
        b->iovs[niov].iov_base = q->dst;
        b->iovs[niov].iov_len = (size_t)q->len;
        niov++;
        cur->niov++;
        cur->nreq++;
        cur->len += gap + q->len;
        if (!is_aligned_ptr(q->dst, A) || (q->len % A) != 0 || (gap % A) != 0) cur->aligned = 0;
    }
    b->nruns = nruns;
    if (biggest_gap > 0) {
        void *mem = NULL;
        size_t al = (size_t)(A > 64 ? A : 64);
        if (posix_memalign(&mem, al, (size_t)align_up(biggest_gap, al)) != 0) return ENOMEM;
        b->gap_scratch = mem;
        for (size_t k = 0; k < niov; k++)
            if (!b->iovs[k].iov_base) b->iovs[k].iov_base = b->gap_scratch;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Python glue                                                                           */

typedef struct {
    PyObject_HEAD
    pool_t p;
    PyObject *path; /* str */
} PoolObject;

typedef struct {
    PyObject_HEAD
    PoolObject *pool;
    batch_t *batch;
    Py_buffer view; /* the destination, held until the batch is harvested */
    int has_view;
    int waiters;
    int harvested;
    /* harvested result */
    int64_t result_bytes;
    int failed;
    int err_errno;
    int64_t err_off, err_len, err_idx, err_got, err_run_off, err_run_len;
    uint32_t err_run_nreq;
} HandleObject;

static PyTypeObject PoolType;
static PyTypeObject HandleType;

/* Raise mlx_flash.errors.ReadError(errno, message, path) with .offset/.length set. */
static void raise_read_error(PyObject *path, int err, long long off, long long len, const char *fmt, ...) {
    char msg[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    PyObject *full = PyUnicode_FromFormat("%s: path=%S, offset=%lld, length=%lld", msg, path ? path : Py_None, off, len);
    if (!full) return;
    PyObject *cls = NULL, *mod = PyImport_ImportModule("mlx_flash.errors");
    if (mod) {
        cls = PyObject_GetAttrString(mod, "ReadError");
        Py_DECREF(mod);
    }
    if (!cls) {
        PyErr_Clear();
        cls = PyExc_OSError;
        Py_INCREF(cls);
    }
    PyObject *exc = PyObject_CallFunction(cls, "iOO", err ? err : EIO, full, path ? path : Py_None);
    Py_DECREF(cls);
    Py_DECREF(full);
    if (!exc) return;
    PyObject *o = PyLong_FromLongLong(off), *l = PyLong_FromLongLong(len);
    if (o && l) {
        PyObject_SetAttrString(exc, "offset", o);
        PyObject_SetAttrString(exc, "length", l);
    }
    Py_XDECREF(o);
    Py_XDECREF(l);
    PyErr_Clear();
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}

static int parse_index_array(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 buffer (e.g. numpy.int64 array), got format '%s'", name,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Validate arguments and build a batch.  On success *out holds the batch and dview the
 * destination buffer (released by the caller). */
static int build_batch(PoolObject *self, PyObject *dest, PyObject *fo, PyObject *ln, PyObject *dof, int coalesce,
                       Py_buffer *dview, batch_t **out) {
    Py_buffer vf, vl, vd;
    int ok = 0;
    *out = NULL;
    if (self->p.closed || self->p.shutdown) {
        raise_read_error(self->path, EBADF, 0, 0, "read on a closed pool");
        return -1;
    }
    if (PyObject_GetBuffer(dest, dview, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS) != 0) return -1;
    if (parse_index_array(fo, &vf, "file_offsets") != 0) goto fail_d;
    if (parse_index_array(ln, &vl, "lengths") != 0) goto fail_f;
    if (parse_index_array(dof, &vd, "dest_offsets") != 0) goto fail_l;
    Py_ssize_t n = vf.len / 8;
    if (n > ((Py_ssize_t)1 << 30)) {
        PyErr_Format(PyExc_ValueError, "at most 2**30 requests per batch, got %zd", n);
        goto fail_all;
    }
    if (vl.len / 8 != n || vd.len / 8 != n) {
        raise_read_error(self->path, EINVAL, n ? ((int64_t *)vf.buf)[0] : 0, vl.len / 8 ? ((int64_t *)vl.buf)[0] : 0,
                         "mismatched index arrays (file_offsets has %zd entries, lengths %zd, dest_offsets %zd)", n,
                         vl.len / 8, vd.len / 8);
        goto fail_all;
    }
    const int64_t *F = vf.buf, *L = vl.buf, *D = vd.buf;
    batch_t *b = calloc(1, sizeof(batch_t));
    if (!b) {
        PyErr_NoMemory();
        goto fail_all;
    }
    pthread_cond_init(&b->cond, NULL);
    atomic_init(&b->next, 0);
    atomic_init(&b->failed, 0);
    b->reqs = malloc((n ? (size_t)n : 1) * sizeof(req_t));
    if (!b->reqs) {
        batch_free(b);
        PyErr_NoMemory();
        goto fail_all;
    }
    size_t m = 0;
    int64_t total = 0, maxgap = coalesce ? self->p.max_gap : -1, maxreq = self->p.max_request;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t f = F[i], l = L[i], d = D[i];
        if (f < 0 || l < 0 || d < 0) {
            raise_read_error(self->path, EINVAL, f, l, "negative value in request %zd (dest_offset=%lld)", i,
                             (long long)d);
            batch_free(b);
            goto fail_all;
        }
        if (l > (int64_t)dview->len || d > (int64_t)dview->len - l) {
            raise_read_error(self->path, EINVAL, f, l,
                             "destination too small for request %zd (dest_offset=%lld + length > %zd bytes)", i,
                             (long long)d, dview->len);
            batch_free(b);
            goto fail_all;
        }
        if (f > INT64_MAX - l) {
            raise_read_error(self->path, EINVAL, f, l, "file range overflows in request %zd", i);
            batch_free(b);
            goto fail_all;
        }
        if (l == 0) continue;
        b->reqs[m].foff = f;
        b->reqs[m].len = l;
        b->reqs[m].dst = (char *)dview->buf + d;
        b->reqs[m].idx = i;
        b->reqs[m].ofoff = f;
        b->reqs[m].olen = l;
        m++;
        total += l;
    }
    b->nreqs = m;
    b->nreads = m;
    b->bytes_requested = total;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = batch_plan(&self->p, b, maxgap, maxreq);
    Py_END_ALLOW_THREADS
    if (rc) {
        batch_free(b);
        PyErr_NoMemory();
        goto fail_all;
    }
    *out = b;
    ok = 1;
fail_all:
    PyBuffer_Release(&vd);
fail_l:
    PyBuffer_Release(&vl);
fail_f:
    PyBuffer_Release(&vf);
fail_d:
    if (!ok) PyBuffer_Release(dview);
    return ok ? 0 : -1;
}

static void raise_batch_error(PyObject *path, int err, int64_t off, int64_t len, int64_t idx, int64_t got,
                              int64_t run_off, int64_t run_len, uint32_t run_nreq) {
    char extra[200] = "";
    if (run_nreq > 1 || run_off != off || run_len != len)
        snprintf(extra, sizeof(extra), " (in a read of %u request piece(s) at offset %lld, length %lld)", run_nreq,
                 (long long)run_off, (long long)run_len);
    if (err == 0)
        raise_read_error(path, EIO, off, len, "short read (end of file at offset %lld) in request %lld%s",
                         (long long)got, (long long)idx, extra);
    else
        raise_read_error(path, err, off, len, "read failed: %s in request %lld%s", strerror(err), (long long)idx, extra);
}

/* The O_DIRECT alignment the filesystem asks for (statx STATX_DIOALIGN, Linux >= 6.1):
 * max(memory, file offset) alignment, or 0 when unknown. */
static int64_t dio_alignment(int fd) {
#if defined(__linux__) && defined(STATX_DIOALIGN) && defined(AT_EMPTY_PATH)
    struct statx sx;
    memset(&sx, 0, sizeof(sx));
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        sx.stx_dio_offset_align > 0) {
        int64_t a = sx.stx_dio_offset_align > sx.stx_dio_mem_align ? sx.stx_dio_offset_align : sx.stx_dio_mem_align;
        if ((a & (a - 1)) == 0) return a;
    }
#else
    (void)fd;
#endif
    return 0;
}

static int pool_start(pool_t *p, PyObject *path_bytes, int threads, int direct) {
    const char *cpath = PyBytes_AS_STRING(path_bytes);
    int flags = O_RDONLY | O_CLOEXEC;
#ifdef O_DIRECT
    if (direct) flags |= O_DIRECT;
#endif
    p->fd = open(cpath, flags);
    if (p->fd < 0) return errno;
    if (p->alignment == 0) { /* auto: what the filesystem asks for, 4096 when it does not say */
        int64_t a = dio_alignment(p->fd);
        p->alignment = a > 0 ? a : 4096;
    }
#if defined(__APPLE__)
    if (direct && fcntl(p->fd, F_NOCACHE, 1) == -1) { /* untested here: the CI machine is Linux */
        int e = errno;
        close(p->fd);
        p->fd = -1;
        return e;
    }
    if (direct) (void)fcntl(p->fd, F_RDAHEAD, 0);
#elif !defined(O_DIRECT)
    (void)direct;
#endif
    p->nthreads = threads;
    p->pid = getpid();
    p->workers = calloc((size_t)threads, sizeof(worker_t));
    if (!p->workers) return ENOMEM;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->close_mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    p->inited = 1;
    p->started = 0;
    for (int i = 0; i < threads; i++) {
        p->workers[i].pool = p;
        int rc = pthread_create(&p->workers[i].tid, NULL, worker_main, &p->workers[i]);
        if (rc) return rc;
        p->started++;
    }
    return 0;
}

/* Shut down: drain queued batches, join the threads, close the fd.  Called without the GIL. */
static void pool_shutdown(pool_t *p) {
    if (!p->inited) {
        if (p->fd >= 0) close(p->fd);
        p->fd = -1;
        p->closed = 1;
        return;
    }
    pthread_mutex_lock(&p->close_mu);
    if (!p->closed) {
        pthread_mutex_lock(&p->mu);
        p->shutdown = 1;
        pthread_cond_broadcast(&p->work_cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->started; i++) pthread_join(p->workers[i].tid, NULL);
        if (p->fd >= 0) close(p->fd);
        p->fd = -1;
        p->closed = 1;
    }
    pthread_mutex_unlock(&p->close_mu);
}

static int Pool_init(PoolObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "threads", "direct", "alignment", "max_gap", "max_request", "bounce", NULL};
    PyObject *path_obj = NULL, *path_bytes = NULL;
    int threads = 32, direct = 1;
    long long alignment = 0, max_gap = 0, max_request = 1 << 20, bounce = BOUNCE_BYTES;
    if (self->p.workers || self->path) {
        PyErr_SetString(PyExc_RuntimeError, "Pool.__init__ called twice");
        return -1;
    }
    self->p.fd = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$ipLLLL", kwlist, &path_obj, &threads, &direct, &alignment, &max_gap,
                                     &max_request, &bounce))
        return -1;
    if (bounce < 4096) {
        PyErr_Format(PyExc_ValueError, "bounce must be >= 4096 bytes, got %lld", bounce);
        return -1;
    }
    if (!PyUnicode_FSConverter(path_obj, &path_bytes)) return -1;
    self->path = PyUnicode_DecodeFSDefault(PyBytes_AS_STRING(path_bytes));
    if (!self->path) {
        Py_DECREF(path_bytes);
        return -1;
    }
    if (threads < 1 || threads > MAX_THREADS) {
        Py_DECREF(path_bytes);
        PyErr_Format(PyExc_ValueError, "threads must be in 1..%d, got %d", MAX_THREADS, threads);
        return -1;
    }
    if (alignment < 0 || (alignment & (alignment - 1)) != 0) {
        Py_DECREF(path_bytes);
        PyErr_Format(PyExc_ValueError, "alignment must be a power of two (0: ask the filesystem), got %lld",
                     alignment);
        return -1;
    }
    if (max_gap < 0 || max_request < 0) {
        Py_DECREF(path_bytes);
        PyErr_SetString(PyExc_ValueError, "max_gap and max_request must be >= 0");
        return -1;
    }
    self->p.direct = direct;
#if defined(O_DIRECT)
    self->p.alignment = direct ? alignment : 1; /* O_DIRECT: offsets, lengths, addresses */
#else
    self->p.alignment = 1; /* F_NOCACHE (macOS) has no alignment rule; cached mode neither */
#endif
    self->p.max_gap = max_gap;
    self->p.bounce_bytes = align_up(bounce, 4096); /* a multiple of any O_DIRECT alignment */
    atomic_init(&self->p.bytes_read, 0);
    atomic_init(&self->p.bytes_requested, 0);
    atomic_init(&self->p.requests, 0);
    atomic_init(&self->p.reads, 0);
    atomic_init(&self->p.batches, 0);
    atomic_init(&self->p.busy_ns, 0);
    self->p.inflight = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pool_start(&self->p, path_bytes, threads, direct);
    if (rc) pool_shutdown(&self->p);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_bytes);
    if (rc) {
        raise_read_error(self->path, rc, 0, 0, "cannot open for %s reads: %s",
                         direct ? "uncached (O_DIRECT/F_NOCACHE)" : "cached", strerror(rc));
        return -1;
    }
    if (self->p.alignment < 1) self->p.alignment = 1;
    self->p.max_request = max_request > 0 ? align_up(max_request, self->p.alignment) : max_request;
    return 0;
}

static void Pool_dealloc(PoolObject *self) {
    if (self->p.inited || self->p.fd >= 0) {
        Py_BEGIN_ALLOW_THREADS
        pool_shutdown(&self->p);
        Py_END_ALLOW_THREADS
    }
    if (self->p.inited) {
        pthread_mutex_destroy(&self->p.mu);
        pthread_mutex_destroy(&self->p.close_mu);
        pthread_cond_destroy(&self->p.work_cv);
    }
    free(self->p.workers);
    Py_XDECREF(self->path);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw;
    PoolObject *self = (PoolObject *)type->tp_alloc(type, 0);
    if (self) self->p.fd = -1;
    return (PyObject *)self;
}

static int check_open(PoolObject *self) {
    if (!self->p.inited) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is not initialised");
        return -1;
    }
    return 0;
}

static void raise_enqueue_error(PoolObject *self, batch_t *b, int rc) {
    raise_read_error(self->path, EBADF, b->nreqs ? b->reqs[0].foff : 0, b->nreqs ? b->reqs[0].len : 0,
                     rc == -2 ? "read on a pool created in another process (fork): open a new one"
                              : "read on a closed pool");
}

static char *read_kwlist[] = {"dest", "file_offsets", "lengths", "dest_offsets", "coalesce", NULL};

/* harvest a finished batch into the handle (GIL held); releases the destination */
static void handle_harvest(HandleObject *h) {
    batch_t *b = h->batch;
    if (h->harvested || !b) return;
    h->harvested = 1;
    h->result_bytes = b->bytes_requested;
    h->failed = atomic_load(&b->failed);
    if (h->failed) {
        h->err_errno = b->err_errno;
        h->err_off = b->err_off;
        h->err_len = b->err_len;
        h->err_idx = b->err_idx;
        h->err_got = b->err_got;
        h->err_run_off = b->err_run_off;
        h->err_run_len = b->err_run_len;
        h->err_run_nreq = b->err_run_nreq;
    }
    if (h->has_view) {
        PyBuffer_Release(&h->view);
        h->has_view = 0;
    }
}

static PyObject *handle_result(HandleObject *h) {
    if (h->failed) {
        raise_batch_error(h->pool->path, h->err_errno, h->err_off, h->err_len, h->err_idx, h->err_got, h->err_run_off,
                          h->err_run_len, h->err_run_nreq);
        return NULL;
    }
    return PyLong_FromLongLong(h->result_bytes);
}

static PyObject *Handle_wait(HandleObject *h, PyObject *unused) {
    (void)unused;
    if (h->batch && !h->harvested) {
        batch_t *b = h->batch;
        pool_t *p = &h->pool->p;
        h->waiters++;
        Py_BEGIN_ALLOW_THREADS
        batch_wait(p, b);
        Py_END_ALLOW_THREADS
        h->waiters--;
        handle_harvest(h);
    }
    if (h->batch && h->waiters == 0) { /* the last waiter frees the batch */
        batch_free(h->batch);
        h->batch = NULL;
    }
    return handle_result(h);
}

static PyObject *Handle_done(HandleObject *h, void *closure) {
    (void)closure;
    int done = 1;
    if (h->batch && !h->harvested) {
        pthread_mutex_lock(&h->pool->p.mu);
        done = h->batch->finished;
        pthread_mutex_unlock(&h->pool->p.mu);
    }
    return PyBool_FromLong(done);
}

static void Handle_dealloc(HandleObject *h) {
    if (h->batch) {
        if (!h->harvested) {
            Py_BEGIN_ALLOW_THREADS
            batch_wait(&h->pool->p, h->batch);
            Py_END_ALLOW_THREADS
            handle_harvest(h);
        }
        batch_free(h->batch);
        h->batch = NULL;
    }
    if (h->has_view) PyBuffer_Release(&h->view);
    Py_XDECREF(h->pool);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *Pool_submit(PoolObject *self, PyObject *args, PyObject *kw) {
    PyObject *dest, *fo, *ln, *dof;
    int coalesce = 1;
    if (check_open(self)) return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$p", read_kwlist, &dest, &fo, &ln, &dof, &coalesce)) return NULL;
    HandleObject *h = PyObject_New(HandleObject, &HandleType);
    if (!h) return NULL;
    h->pool = self;
    Py_INCREF(self);
    h->batch = NULL;
    h->has_view = 0;
    h->waiters = 0;
    h->harvested = 0;
    h->failed = 0;
    h->result_bytes = 0;
    batch_t *b = NULL;
    if (build_batch(self, dest, fo, ln, dof, coalesce, &h->view, &b) != 0) {
        Py_DECREF(h);
        return NULL;
    }
    h->has_view = 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pool_enqueue(&self->p, b);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_enqueue_error(self, b, rc);
        batch_free(b);
        Py_DECREF(h);
        return NULL;
    }
    h->batch = b;
    return (PyObject *)h;
}

static PyObject *Pool_read(PoolObject *self, PyObject *args, PyObject *kw) {
    PyObject *dest, *fo, *ln, *dof;
    int coalesce = 1;
    Py_buffer view;
    batch_t *b = NULL;
    if (check_open(self)) return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$p", read_kwlist, &dest, &fo, &ln, &dof, &coalesce)) return NULL;
    if (build_batch(self, dest, fo, ln, dof, coalesce, &view, &b) != 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pool_enqueue(&self->p, b);
    if (!rc) batch_wait(&self->p, b);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *result = NULL;
    if (rc)
        raise_enqueue_error(self, b, rc);
    else if (atomic_load(&b->failed))
        raise_batch_error(self->path, b->err_errno, b->err_off, b->err_len, b->err_idx, b->err_got, b->err_run_off,
                          b->err_run_len, b->err_run_nreq);
    else
        result = PyLong_FromLongLong(b->bytes_requested);
    batch_free(b);
    return result;
}

static PyObject *Pool_wait(PoolObject *self, PyObject *h) {
    if (!PyObject_TypeCheck(h, &HandleType)) {
        PyErr_SetString(PyExc_TypeError, "wait() expects a handle returned by submit()");
        return NULL;
    }
    if (((HandleObject *)h)->pool != self) {
        PyErr_SetString(PyExc_ValueError, "wait(): the handle belongs to another pool");
        return NULL;
    }
    return Handle_wait((HandleObject *)h, NULL);
}

static PyObject *Pool_close(PoolObject *self, PyObject *unused) {
    (void)unused;
    if (self->p.inited || self->p.fd >= 0) {
        Py_BEGIN_ALLOW_THREADS
        pool_shutdown(&self->p);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Pool_enter(PoolObject *self, PyObject *unused) {
    (void)unused;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Pool_exit(PoolObject *self, PyObject *args) {
    (void)args;
    PyObject *r = Pool_close(self, NULL);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *Pool_stats(PoolObject *self, PyObject *unused) {
    (void)unused;
    pool_t *p = &self->p;
    pthread_mutex_lock(&p->mu); /* the busy period in progress counts up to now */
    long long busy = (long long)atomic_load(&p->busy_ns) + (p->inflight ? now_ns() - p->busy_since : 0);
    pthread_mutex_unlock(&p->mu);
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L}", "bytes_read", (long long)atomic_load(&p->bytes_read),
                         "bytes_requested", (long long)atomic_load(&p->bytes_requested), "requests",
                         (long long)atomic_load(&p->requests), "reads", (long long)atomic_load(&p->reads), "batches",
                         (long long)atomic_load(&p->batches), "busy_ns", busy);
}

static PyObject *Pool_reset_stats(PoolObject *self, PyObject *unused) {
    (void)unused;
    pool_t *p = &self->p;
    atomic_store(&p->bytes_read, 0);
    atomic_store(&p->bytes_requested, 0);
    atomic_store(&p->requests, 0);
    atomic_store(&p->reads, 0);
    atomic_store(&p->batches, 0);
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->busy_ns, 0);
    p->busy_since = now_ns();
    pthread_mutex_unlock(&p->mu);
    Py_RETURN_NONE;
}

#define COUNTER_GETTER(name)                                                                                           \
    static PyObject *Pool_get_##name(PoolObject *self, void *c) {                                                      \
        (void)c;                                                                                                       \
        return PyLong_FromLongLong((long long)atomic_load(&self->p.name));                                             \
    }
COUNTER_GETTER(bytes_read)
COUNTER_GETTER(bytes_requested)
COUNTER_GETTER(requests)
COUNTER_GETTER(reads)
COUNTER_GETTER(batches)

static PyObject *Pool_get_threads(PoolObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->p.nthreads);
}
static PyObject *Pool_get_direct(PoolObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->p.direct);
}
static PyObject *Pool_get_alignment(PoolObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(self->p.alignment);
}
static PyObject *Pool_get_closed(PoolObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->p.closed || self->p.shutdown);
}
static PyObject *Pool_get_fd(PoolObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->p.fd);
}
static PyObject *Pool_get_path(PoolObject *self, void *c) {
    (void)c;
    Py_INCREF(self->path ? self->path : Py_None);
    return self->path ? self->path : Py_None;
}
static PyObject *Pool_get_max_gap(PoolObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(self->p.max_gap);
}
static int Pool_set_max_gap(PoolObject *self, PyObject *v, void *c) {
    (void)c;
    long long x = v ? PyLong_AsLongLong(v) : -1;
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < 0) {
        PyErr_SetString(PyExc_ValueError, "max_gap must be >= 0");
        return -1;
    }
    self->p.max_gap = x;
    return 0;
}
static PyObject *Pool_get_max_request(PoolObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(self->p.max_request);
}
static int Pool_set_max_request(PoolObject *self, PyObject *v, void *c) {
    (void)c;
    long long x = v ? PyLong_AsLongLong(v) : -1;
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < 0) {
        PyErr_SetString(PyExc_ValueError, "max_request must be >= 0 (0: no limit)");
        return -1;
    }
    self->p.max_request = x > 0 ? align_up(x, self->p.alignment > 1 ? self->p.alignment : 1) : 0;
    return 0;
}

static PyGetSetDef Pool_getset[] = {
    {"threads", (getter)Pool_get_threads, NULL, "number of worker threads", NULL},
    {"direct", (getter)Pool_get_direct, NULL, "True: uncached reads (O_DIRECT / F_NOCACHE)", NULL},
    {"alignment", (getter)Pool_get_alignment, NULL, "O_DIRECT alignment in bytes (1: none needed)", NULL},
    {"closed", (getter)Pool_get_closed, NULL, "True after close()", NULL},
    {"fd", (getter)Pool_get_fd, NULL, "the file descriptor (-1 when closed)", NULL},
    {"path", (getter)Pool_get_path, NULL, "the file path", NULL},
    {"max_gap", (getter)Pool_get_max_gap, (setter)Pool_set_max_gap,
     "largest gap (bytes) between two requests that is read and discarded to merge them", NULL},
    {"max_request", (getter)Pool_get_max_request, (setter)Pool_set_max_request,
     "largest single read (bytes); longer requests are split, merging stops there (0: no limit)", NULL},
    {"bytes_read", (getter)Pool_get_bytes_read, NULL, "bytes transferred from the file (gaps, bounce included)", NULL},
    {"bytes_requested", (getter)Pool_get_bytes_requested, NULL, "bytes asked for by callers", NULL},
    {"requests", (getter)Pool_get_requests, NULL, "read syscalls issued (after coalescing)", NULL},
    {"reads", (getter)Pool_get_reads, NULL, "non-empty reads asked for by callers", NULL},
    {"batches", (getter)Pool_get_batches, NULL, "batches submitted", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef Pool_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Pool_read, METH_VARARGS | METH_KEYWORDS,
     "read(dest, file_offsets, lengths, dest_offsets, *, coalesce=True) -> int\n\n"
     "Read file[file_offsets[i] : +lengths[i]] into dest[dest_offsets[i] : +lengths[i]] for every i\n"
     "(three int64 buffers of equal length; dest a writable contiguous buffer). Returns the bytes\n"
     "requested when every read is done; the GIL is released meanwhile. Raises ReadError."},
    {"submit", (PyCFunction)(void (*)(void))Pool_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(dest, file_offsets, lengths, dest_offsets, *, coalesce=True) -> Handle\n\n"
     "Like read() but returns at once; the handle keeps dest alive. Pass it to wait()."},
    {"wait", (PyCFunction)Pool_wait, METH_O, "wait(handle) -> int: block until the batch is done (raises ReadError)"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "finish queued batches, join the threads, close the file"},
    {"stats", (PyCFunction)Pool_stats, METH_NOARGS, "cumulative counters as a dict"},
    {"reset_stats", (PyCFunction)Pool_reset_stats, METH_NOARGS, "zero the counters"},
    {"__enter__", (PyCFunction)Pool_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Pool_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mlx_flash._pread_pool.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(path, *, threads=32, direct=True, alignment=0, max_gap=0, max_request=1048576)\n\n"
              "alignment=0: the O_DIRECT alignment the filesystem reports (statx), else 4096.\n"
              "A pthread pool that executes batches of preads from one file (O_DIRECT on Linux, F_NOCACHE on\n"
              "macOS when direct=True), coalescing neighbouring requests.",
    .tp_new = Pool_new,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

static PyMethodDef Handle_methods[] = {
    {"wait", (PyCFunction)Handle_wait, METH_NOARGS, "wait() -> int: block until the batch is done (raises ReadError)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Handle_getset[] = {
    {"done", (getter)Handle_done, NULL, "True when every read of the batch has finished", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mlx_flash._pread_pool.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A batch in flight (from Pool.submit); keeps the destination alive until waited.",
    .tp_dealloc = (destructor)Handle_dealloc,
    .tp_methods = Handle_methods,
    .tp_getset = Handle_getset,
};

/* ---- checksums -------------------------------------------------------------------------------------------- */

/* zlib's CRC-32 (reflected 0xEDB88320): the checksum convert writes per unit, checked here where units land.
 * The system's zlib where it can be opened (its braided CRC is about 3x faster than the table below), else eight
 * bytes a step ("slicing by 8"), so nothing needs zlib's headers to build. */
typedef unsigned long (*zlib_crc32_t)(unsigned long, const unsigned char *, unsigned int);
static zlib_crc32_t zlib_crc32;
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
#ifdef __APPLE__
    const char *libz = "libz.1.dylib";
#else
    const char *libz = "libz.so.1";
#endif
    void *z = getenv("MLX_FLASH_NO_ZLIB") ? NULL : dlopen(libz, RTLD_NOW | RTLD_LOCAL); /* (tests: the table) */
    if (z) zlib_crc32 = (zlib_crc32_t)dlsym(z, "crc32");
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

static uint32_t crc32_bytes(const unsigned char *p, size_t n) {
    if (zlib_crc32 && n <= UINT_MAX) return (uint32_t)zlib_crc32(0, p, (unsigned int)n);
    uint32_t c = 0xFFFFFFFFu;
    for (; n && ((uintptr_t)p & 7); n--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c; /* little-endian: the running CRC meets the first four bytes */
        c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
            crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
            crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
    }
    for (; n; n--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static PyObject *module_crc32(PyObject *unused, PyObject *args) {
    (void)unused;
    PyObject *src, *offsets, *out;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "OOnO", &src, &offsets, &length, &out)) return NULL;
    Py_buffer vs, vo, vout;
    if (PyObject_GetBuffer(src, &vs, PyBUF_ANY_CONTIGUOUS) != 0) return NULL;
    if (parse_index_array(offsets, &vo, "offsets") != 0) goto fail_s;
    if (PyObject_GetBuffer(out, &vout, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) goto fail_o;
    Py_ssize_t n = vo.len / 8;
    const int64_t *O = vo.buf;
    if (vout.len != 4 * n || length < 0) {
        PyErr_Format(PyExc_ValueError, "out must hold one uint32 per offset (%zd), length >= 0", n);
        goto fail_all;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (O[i] < 0 || O[i] > vs.len - length) {
            PyErr_Format(PyExc_ValueError, "offset %lld + %zd outside the %zd-byte buffer", (long long)O[i], length,
                         vs.len);
            goto fail_all;
        }
    pthread_once(&crc_once, crc_init);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++)
        ((uint32_t *)vout.buf)[i] = crc32_bytes((const unsigned char *)vs.buf + O[i], (size_t)length);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&vout);
    PyBuffer_Release(&vo);
    PyBuffer_Release(&vs);
    Py_RETURN_NONE;
fail_all:
    PyBuffer_Release(&vout);
fail_o:
    PyBuffer_Release(&vo);
fail_s:
    PyBuffer_Release(&vs);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"crc32", module_crc32, METH_VARARGS,
     "crc32(src, offsets, length, out): out[i] = zlib.crc32(src[offsets[i] : offsets[i] + length]) for every i\n"
     "(offsets an int64 buffer, out a writable uint32 buffer); the GIL is released meanwhile."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pread_pool", "Native pread thread pool of mlx_flash (see mlx_flash.reader).", -1, module_methods,
    NULL,                  NULL,          NULL,                                                           NULL};

PyMODINIT_FUNC PyInit__pread_pool(void) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&HandleType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&HandleType);
    if (PyModule_AddObject(m, "Handle", (PyObject *)&HandleType) < 0) {
        Py_DECREF(&HandleType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "IOV_MAX", MAX_IOV);
#ifdef O_DIRECT
    PyModule_AddIntConstant(m, "HAVE_O_DIRECT", 1);
#else
    PyModule_AddIntConstant(m, "HAVE_O_DIRECT", 0);
#endif
    return m;
}
