//! The POSIX path's persistent I/O threads: started on first use, kept for the life of the
//! process, woken per transfer. A transfer runs on the calling thread and on up to `helpers` of
//! these threads at once ([`Workers::run`]); the caller takes part, so a transfer always
//! finishes even when every pool thread is busy with other transfers (or none could be started).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// The most pool threads the process starts.
pub(crate) const MAX_WORKERS: usize = 255;

/// Work shared by the participants of one transfer.
pub(crate) trait Job: Send + Sync + 'static {
    /// Take part in the transfer as participant `p` (0 is the caller, 1.. pool threads). Must
    /// not return while anything it queued can still touch the transfer's memory.
    fn participate(&self, p: usize);
}

/// Participants of one transfer still inside [`Job::participate`].
#[derive(Default)]
struct Active {
    n: Mutex<usize>,
    zero: Condvar,
}

impl Active {
    fn leave(&self) {
        let mut n = lock(&self.n);
        *n -= 1;
        if *n == 0 {
            self.zero.notify_all();
        }
    }

    fn wait_zero(&self) {
        let mut n = lock(&self.n);
        while *n > 0 {
            n = self.zero.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A place in a transfer, waiting for a pool thread.
struct Ticket {
    job: Arc<dyn Job>,
    active: Arc<Active>,
    participant: usize,
}

struct State {
    queue: VecDeque<Ticket>,
    threads: usize,
    /// The process the threads belong to (a forked child has none of them).
    pid: u32,
}

/// The pool.
pub(crate) struct Workers {
    state: Mutex<State>,
    work: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Workers {
    /// The process's pool.
    pub(crate) fn global() -> &'static Workers {
        static W: OnceLock<Workers> = OnceLock::new();
        W.get_or_init(|| Workers {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                threads: 0,
                pid: std::process::id(),
            }),
            work: Condvar::new(),
        })
    }

    /// The pool threads started so far.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        lock(&self.state).threads
    }

    /// Run `job` on this thread (participant 0) and on up to `helpers` pool threads
    /// (participants `1..=helpers`), starting threads as needed. Returns once every participant
    /// has returned from [`Job::participate`] and no pool thread can still join: places not
    /// taken by the time this thread is done are withdrawn.
    pub(crate) fn run(&'static self, job: Arc<dyn Job>, helpers: usize) {
        let helpers = helpers.min(MAX_WORKERS);
        let active = Arc::new(Active::default());
        if helpers > 0 {
            let mut st = lock(&self.state);
            let me = std::process::id();
            if st.pid != me {
                // A forked child: the parent's threads are not here.
                st.threads = 0;
                st.queue.clear();
                st.pid = me;
            }
            while st.threads < helpers {
                let n = st.threads;
                let spawned =
                    crate::driver::ctx::spawn_thread(format!("gpudirect-io-{n}"), move || {
                        self.serve()
                    });
                if spawned.is_err() {
                    break; // fewer helpers: the caller does the rest
                }
                st.threads += 1;
            }
            for participant in 1..=helpers {
                st.queue.push_back(Ticket {
                    job: job.clone(),
                    active: active.clone(),
                    participant,
                });
            }
            drop(st);
            // One wake per place: a pool larger than this transfer (after a transfer with more
            // threads) does not wake every idle thread to find the queue empty. A woken thread
            // that finds it empty waits again; a busy one looks at the queue before it waits.
            for _ in 1..=helpers {
                self.work.notify_one();
            }
        }
        // The caller takes part; a panic in it is caught so that the withdrawal and the wait
        // below always run (the participants may still be using the transfer's memory).
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.participate(0)));
        if helpers > 0 {
            lock(&self.state)
                .queue
                .retain(|t| !Arc::ptr_eq(&t.active, &active));
            active.wait_zero();
        }
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
    }

    /// A pool thread: take places in transfers, forever.
    fn serve(&self) {
        loop {
            let ticket = {
                let mut st = lock(&self.state);
                loop {
                    if let Some(t) = st.queue.pop_front() {
                        // Counted while the queue is locked, so that the caller's withdrawal and
                        // this start never miss each other.
                        *lock(&t.active.n) += 1;
                        break t;
                    }
                    st = self.work.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            };
            let Ticket {
                job,
                active,
                participant,
            } = ticket;
            // A panic ends this participation only; the pool thread goes on.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                job.participate(participant)
            }));
            drop(job);
            active.leave();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    struct Count {
        seen: Mutex<HashSet<usize>>,
        running: AtomicUsize,
        most: AtomicUsize,
        nap: Duration,
    }

    impl Count {
        fn new(nap: Duration) -> Arc<Count> {
            Arc::new(Count {
                seen: Mutex::new(HashSet::new()),
                running: AtomicUsize::new(0),
                most: AtomicUsize::new(0),
                nap,
            })
        }
    }

    impl Job for Count {
        fn participate(&self, p: usize) {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            lock(&self.seen).insert(p);
            std::thread::sleep(self.nap);
            self.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn participants_run_at_once_and_all_return_before_run_does() {
        let job = Count::new(Duration::from_millis(200));
        Workers::global().run(job.clone(), 5);
        assert_eq!(job.running.load(Ordering::SeqCst), 0, "nobody still inside");
        assert!(Workers::global().threads() >= 5);
        // The caller always takes part; pool threads join while it sleeps (they may be busy with
        // other tests' transfers, so only "more than one at once" is certain enough).
        assert!(lock(&job.seen).contains(&0));
        assert!(job.most.load(Ordering::SeqCst) >= 2, "ran concurrently");
    }

    #[test]
    fn no_helpers_runs_on_the_caller_only() {
        let job = Count::new(Duration::ZERO);
        Workers::global().run(job.clone(), 0);
        assert_eq!(*lock(&job.seen), HashSet::from([0]));
    }

    struct Panics;
    impl Job for Panics {
        fn participate(&self, p: usize) {
            if p > 0 {
                panic!("participant {p} panics");
            }
        }
    }

    #[test]
    fn a_panicking_pool_participant_leaves_the_pool_usable() {
        Workers::global().run(Arc::new(Panics), 3);
        let job = Count::new(Duration::from_millis(50));
        Workers::global().run(job.clone(), 3);
        assert!(lock(&job.seen).contains(&0));
    }
}
