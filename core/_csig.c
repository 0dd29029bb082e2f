/* SIGTERM seen off the main thread, for ckpt_core.saving.lifecycle (loaded through ctypes; no Python API).
 *
 * Python runs a signal's Python handler only when its main thread returns to the interpreter: a main
 * thread blocked in C code (a collective or rendezvous waiting for a peer that never comes) never runs
 * checkrun's SIGTERM grace, and the process did not end at SIGTERM at all, as it does with no handler.
 * ``checkrun_sigterm_hook`` puts ``on_signal`` in front of the C handler installed now (Python's): it
 * posts a semaphore, which a checkrun thread waits on (``checkrun_sigterm_wait``, without the GIL), then
 * calls Python's handler as before. That thread gives the pending saves their grace and ends the process
 * as SIGTERM with no handler does (``checkrun_sigterm_default``), whatever the main thread is doing.
 *
 * Built by setup.py as the optional extension ckpt_core._csig; without it the grace runs only on the
 * main thread (docs/reliability.md).
 */
#include <errno.h>
#include <semaphore.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

/* Version of this interface; lifecycle.py refuses a library with another one. */
int checkrun_csig_abi(void) { return 1; }

static struct sigaction chained; /* the handler on_signal calls after posting (Python's) */
static sem_t fired;
static int ready = 0;

static void on_signal(int sig, siginfo_t *info, void *ctx) {
    int saved = errno;
    sem_post(&fired); /* async-signal-safe */
    errno = saved;
    if (chained.sa_flags & SA_SIGINFO) {
        if (chained.sa_sigaction != NULL) chained.sa_sigaction(sig, info, ctx);
    } else if (chained.sa_handler != SIG_DFL && chained.sa_handler != SIG_IGN) {
        chained.sa_handler(sig);
    }
}

/* Put on_signal in front of SIGTERM's handler now. Returns 1 if it did, 0 if it is there already, -1
 * if there is no handler to chain (the default or ignore disposition) or the system refused. */
int checkrun_sigterm_hook(void) {
    struct sigaction now, mine;
    if (!ready) {
        if (sem_init(&fired, 0, 0) != 0) return -1;
        ready = 1;
    }
    if (sigaction(SIGTERM, NULL, &now) != 0) return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_signal) return 0;
    if (!(now.sa_flags & SA_SIGINFO) && (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN)) return -1;
    chained = now; /* on_signal is not installed while this is written */
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_signal;
    mine.sa_mask = now.sa_mask;
    mine.sa_flags = SA_SIGINFO | (now.sa_flags & (SA_ONSTACK | SA_RESTART));
    return sigaction(SIGTERM, &mine, NULL) == 0 ? 1 : -1;
}

/* Block until on_signal has run once more than this has returned (call it without the GIL). */
void checkrun_sigterm_wait(void) {
    while (sem_wait(&fired) != 0 && errno == EINTR) {
    }
}

/* End the process as SIGTERM does with no handler installed. */
void checkrun_sigterm_default(void) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGTERM, &dfl, NULL);
    kill(getpid(), SIGTERM);
}
