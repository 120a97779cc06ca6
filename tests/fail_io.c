/* LD_PRELOAD shim for tests/test_diskfull.py: make one system call of a store fail with an errno, as a disk
 * that reports an I/O error (or a quota) does, and let the process go on.
 *
 * The child arms it through ctypes: fail_io_arm(what, n, err) makes the n-th call of kind `what` from then on
 * fail with errno `err` (once; nothing is written or synced by that call):
 *   "meta"   an LMDB meta page write (the commit point of a write transaction): LMDB writes meta pages with
 *            pwrite() through a descriptor opened O_DSYNC, data pages through a plain one;
 * fail_io_fired() says how many calls it failed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static char armed[16];
static int countdown, fail_errno, fired;

void fail_io_arm(const char *what, int n, int err) {
    snprintf(armed, sizeof armed, "%s", what);
    countdown = n;
    fail_errno = err;
}

int fail_io_fired(void) { return fired; }

static int is_meta_write(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags == -1 || !(flags & O_DSYNC))
        return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(link, path, sizeof path - 1);
    if (len < 8)
        return 0;
    path[len] = 0;
    return strcmp(path + len - 8, "data.mdb") == 0;
}

/* 1 when this call is the one to fail (errno set) */
static int fails(const char *what, int matches) {
    if (!matches || countdown <= 0 || strcmp(armed, what) != 0 || --countdown > 0)
        return 0;
    fired++;
    errno = fail_errno;
    return 1;
}

typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);

static ssize_t forward(pwrite_fn *real, const char *name, int fd, const void *buf, size_t n, off_t off) {
    if (!*real)
        *real = (pwrite_fn)dlsym(RTLD_NEXT, name);
    if (fails("meta", is_meta_write(fd)))
        return -1;
    return (*real)(fd, buf, n, off);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    static pwrite_fn real;
    return forward(&real, "pwrite", fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    static pwrite_fn real;
    return forward(&real, "pwrite64", fd, buf, n, off);
}
