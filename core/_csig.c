/* SIGTERM while checkrun has nothing to save, for ckpt_core.saving.lifecycle (loaded through ctypes;
 * no Python API).
 *
 * checkrun's SIGTERM grace is a Python handler, and Python runs a Python handler only when its main
 * thread returns to the interpreter: a main thread blocked in C code (a collective or rendezvous waiting
 * for a peer that never comes) did not end at SIGTERM at all once a save had installed the handler, as it
 * does with no handler (it ended when the call gave up). ``checkrun_sigterm_hook`` puts ``on_signal`` in
 * front of the C handler installed now (Python's): while checkrun has saves pending (``armed``), it calls
 * Python's handler, whose grace waits for them; while it has none, the signal ends the process at once,
 * as SIGTERM with no handler does.
 *
 * Built by setup.py as the optional extension ckpt_core._csig; without it every SIGTERM goes to the
 * Python handler (docs/reliability.md).
 */
#include <signal.h>
#include <string.h>
#include <unistd.h>

/* Version of this interface; lifecycle.py refuses a library with another one. */
int checkrun_csig_abi(void) { return 2; }

static struct sigaction chained; /* the handler on_signal calls while armed (Python's) */
static volatile sig_atomic_t armed = 1;

static void on_signal(int sig, siginfo_t *info, void *ctx) {
    if (!armed) { /* nothing to wait for: the default action (async-signal-safe calls only) */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGTERM, &dfl, NULL);
        kill(getpid(), SIGTERM); /* delivered once this handler returns */
        return;
    }
    if (chained.sa_flags & SA_SIGINFO) {
        if (chained.sa_sigaction != NULL) chained.sa_sigaction(sig, info, ctx);
    } else if (chained.sa_handler != SIG_DFL && chained.sa_handler != SIG_IGN) {
        chained.sa_handler(sig);
    }
}

/* Put on_signal in front of SIGTERM's handler now (armed). Returns 1 if it did, 0 if it is there already,
 * -1 if there is no handler to chain (the default or ignore disposition) or the system refused. */
int checkrun_sigterm_hook(void) {
    struct sigaction now, mine;
    if (sigaction(SIGTERM, NULL, &now) != 0) return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_signal) return 0;
    if (!(now.sa_flags & SA_SIGINFO) && (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN)) return -1;
    armed = 1;
    chained = now; /* on_signal is not installed while this is written */
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_signal;
    mine.sa_mask = now.sa_mask;
    mine.sa_flags = SA_SIGINFO | (now.sa_flags & (SA_ONSTACK | SA_RESTART));
    return sigaction(SIGTERM, &mine, NULL) == 0 ? 1 : -1;
}

/* 1: saves are pending (SIGTERM goes to Python's handler); 0: none (SIGTERM ends the process). */
void checkrun_sigterm_arm(int on) { armed = on ? 1 : 0; }
