/* LD_PRELOAD shim for tests/test_diskfull.py: make one system call of a store fail with an errno, as a disk
 * that reports an I/O error (or a quota) does, and let the process go on.
 *
 * The child arms it through ctypes: fail_io_arm(what, n, err) makes the n-th call of kind `what` from then on
 * fail with errno `err` (once; nothing is written or synced by that call):
 *   "meta"   an LMDB meta page write (the commit point of a write transaction): LMDB writes meta pages with
 *            pwrite() through a descriptor opened O_DSYNC, data pages through a plain one;
 *   "fsync:PART"  an fsync() or fdatasync() of a file whose path holds PART ("fsync:/manifests/");
 * fail_io_fired() says how many calls it failed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static char armed[4096];
static int countdown, fail_errno, fired;

void fail_io_arm(const char *what, int n, int err) {
    snprintf(armed, sizeof armed, "%s", what);
    countdown = n;
    fail_errno = err;
}

int fail_io_fired(void) { return fired; }

/* the path of descriptor fd into path (empty when unknown) */
static void fd_path(int fd, char *path, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(link, path, size - 1);
    path[len < 0 ? 0 : len] = 0;
}

static int is_meta_write(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags == -1 || !(flags & O_DSYNC))
        return 0;
    char path[4096];
    fd_path(fd, path, sizeof path);
    size_t len = strlen(path);
    return len >= 8 && strcmp(path + len - 8, "data.mdb") == 0;
}

static int is_fsync_of(int fd) {
    char path[4096];
    if (strncmp(armed, "fsync:", 6) != 0)
        return 0;
    fd_path(fd, path, sizeof path);
    return strstr(path, armed + 6) != NULL;
}

/* 1 when this call is the one to fail (errno set) */
static int fails(const char *what, int matches) {
    if (!matches || countdown <= 0 || strncmp(armed, what, strlen(what)) != 0 || --countdown > 0)
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

typedef int (*sync_fn)(int);

static int sync_or_fail(sync_fn *real, const char *name, int fd) {
    if (!*real)
        *real = (sync_fn)dlsym(RTLD_NEXT, name);
    if (fails("fsync:", is_fsync_of(fd)))
        return -1;
    return (*real)(fd);
}

int fsync(int fd) {
    static sync_fn real;
    return sync_or_fail(&real, "fsync", fd);
}

int fdatasync(int fd) {
    static sync_fn real;
    return sync_or_fail(&real, "fdatasync", fd);
}
