/* LD_PRELOAD shim for tests/test_crash.py: SIGKILL the process right after the n-th write of an LMDB meta page
 * (the commit point of a write transaction), before LMDB publishes the new transaction id to the other
 * processes in its lock file. n comes from the environment variable DIE_AFTER_META; unset, nothing changes.
 *
 * LMDB writes a meta page with pwrite() through a descriptor opened O_DSYNC (without MDB_NOMETASYNC), and data
 * pages through a plain one, so "an O_DSYNC pwrite to a file named data.mdb" is a meta page write. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static int meta_writes;

static void after_write(int fd) {
    const char *want = getenv("DIE_AFTER_META");
    int flags = fcntl(fd, F_GETFL);
    if (!want || flags == -1 || !(flags & O_DSYNC))
        return;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(link, path, sizeof path - 1);
    if (len < 8)
        return;
    path[len] = 0;
    if (strcmp(path + len - 8, "data.mdb") == 0 && ++meta_writes >= atoi(want))
        kill(getpid(), SIGKILL);
}

typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);

/* Call libc's `name` (looked up once into *real), then count the write. */
static ssize_t forward(pwrite_fn *real, const char *name, int fd, const void *buf, size_t n, off_t off) {
    if (!*real)
        *real = (pwrite_fn)dlsym(RTLD_NEXT, name);
    ssize_t r = (*real)(fd, buf, n, off);
    after_write(fd);
    return r;
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    static pwrite_fn real;
    return forward(&real, "pwrite", fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    static pwrite_fn real;
    return forward(&real, "pwrite64", fd, buf, n, off);
}
