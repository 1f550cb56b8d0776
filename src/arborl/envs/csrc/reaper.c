/* reaper PROGRAM ARGS...: run PROGRAM as a child subreaper, wait for it and for every process orphaned
 * below it, and exit as PROGRAM did.
 *
 * bubblewrap's monitor exits as soon as the sandbox's init reports the command's status, without waiting
 * for that init: the init is re-parented to the host's nearest subreaper or pid 1 and stays a zombie until
 * that one reaps it (never, where pid 1 is a program that does not reap: a trainer started as a
 * container's entrypoint). Run through this, the orphaned init comes here and is reaped before the
 * command's result is returned.
 *
 * SIGTERM: SIGKILL PROGRAM, reap everything, then die of SIGKILL (the caller sees the same -9 as a
 * killed process group gave before). PROGRAM's death by a signal is passed on as this process's death by
 * the same signal, with core dumps off. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile pid_t child = -1;
static volatile sig_atomic_t terminated = 0;

static void on_term(int sig) {
    (void)sig;
    terminated = 1;
    if (child > 0)
        kill(child, SIGKILL);
}

static void die_of(int sig) {
    struct rlimit none = {0, 0};
    setrlimit(RLIMIT_CORE, &none);
    signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    sigprocmask(SIG_UNBLOCK, &one, NULL);
    kill(getpid(), sig);
    _exit(128 + sig);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s PROGRAM [ARGS...]\n", argv[0]);
        return 2;
    }
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
        perror("reaper: prctl(PR_SET_CHILD_SUBREAPER)");
        return 125;
    }
    sigset_t term, old;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    sigprocmask(SIG_BLOCK, &term, &old); /* no SIGTERM before the child's pid is known */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    pid_t pid = fork();
    if (pid < 0) {
        perror("reaper: fork");
        return 125;
    }
    if (pid == 0) {
        signal(SIGTERM, SIG_DFL);
        sigprocmask(SIG_SETMASK, &old, NULL);
        execvp(argv[1], argv + 1);
        fprintf(stderr, "reaper: cannot execute %s: %s\n", argv[1], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }
    child = pid;
    sigprocmask(SIG_SETMASK, &old, NULL);
    int status = 0, got = 0;
    for (;;) {
        int st;
        pid_t w = waitpid(-1, &st, 0);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            break; /* ECHILD: nothing left below */
        }
        if (w == pid) {
            status = st;
            got = 1;
        }
    }
    if (terminated)
        die_of(SIGKILL);
    if (!got)
        return 125;
    if (WIFSIGNALED(status))
        die_of(WTERMSIG(status));
    return WEXITSTATUS(status);
}
