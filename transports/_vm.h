/* The cross-memory copy shared by the compiled pieces (transports/_ring.c's
   vm_copy, pycoll/_step.c's reductions by address).

   vm_move(pid, local, remote, n, write): n bytes between address local of
   this process and address remote of process pid, by process_vm_readv (write
   0) or process_vm_writev, repeated until all moved.  Returns 0, or the errno
   of the call that failed (EFAULT where one moved nothing).  It takes no
   Python object, so callers run it without the GIL. */
#ifndef PYCOLL_VM_H
#define PYCOLL_VM_H

#include <errno.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

static inline int
vm_move(pid_t pid, char *local, uint64_t remote, size_t n, int write)
{
    size_t done = 0;
    while (done < n) {
        struct iovec l = {local + done, n - done};
        struct iovec r = {(void *)(uintptr_t)(remote + done), n - done};
        ssize_t got = write ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                            : process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got <= 0)
            return got < 0 && errno ? errno : EFAULT;
        done += (size_t)got;
    }
    return 0;
}

#endif
