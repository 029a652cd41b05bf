//! Awaiting `InFlight`s on a multi-threaded tokio runtime, without a GPU (tier 0): completion
//! flags and outcomes wake their futures themselves, a user's fence is polled by the shared
//! completion thread. Exact resources back, cancellation at every await point, typed deadlines
//! whose resources come back through the tracker, and no lost wake-up in a tight race.

mod support;

use gpudirect::Error;
use gpudirect::completion::{CompletionFlag, Fence, InFlight, Outcome, OutcomeSender, Tracker};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// A seed, printed so a failure can be replayed with `FUTURES_TEST_SEED`.
fn seed() -> u64 {
    support::gpu::seed_from("FUTURES_TEST_SEED")
}

/// Counts its drops.
#[derive(Debug)]
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// What an operation owns: an id, random bytes, and a drop counter.
#[derive(Debug)]
struct Owned {
    id: usize,
    bytes: Vec<u8>,
    _count: Counted,
}

/// A user's fence with no wake-up source of its own: the completion thread polls it.
#[derive(Clone, Default)]
struct UserFence(Arc<AtomicBool>);

impl UserFence {
    fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Fence for UserFence {
    fn is_complete(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Counts the polls of the future it wraps (a spinning task would be polled without end).
struct CountPolls<F> {
    inner: F,
    polls: usize,
}

impl<F: Future + Unpin> Future for CountPolls<F> {
    type Output = (F::Output, usize);
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.polls += 1;
        match Pin::new(&mut self.inner).poll(cx) {
            Poll::Ready(v) => Poll::Ready((v, self.polls)),
            Poll::Pending => Poll::Pending,
        }
    }
}

fn count_polls<F: Future + Unpin>(inner: F) -> CountPolls<F> {
    CountPolls { inner, polls: 0 }
}

/// Poll once with a waker that does nothing.
fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

/// Reap until `drops` reaches `want` (bounded), then check it stays there.
fn reap_until(drops: &AtomicUsize, want: usize) {
    let t = Instant::now();
    while drops.load(Ordering::SeqCst) < want {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "only {} of {want} freed",
            drops.load(Ordering::SeqCst)
        );
        Tracker::global().reap();
        std::thread::sleep(Duration::from_micros(200));
    }
    Tracker::global().reap();
    assert_eq!(
        drops.load(Ordering::SeqCst),
        want,
        "freed exactly once each"
    );
}

enum Setter {
    Flag(CompletionFlag),
    User(UserFence),
    Outcome(OutcomeSender<u64>, u64),
}

impl Setter {
    fn set(self) {
        match self {
            Setter::Flag(f) => f.set(),
            Setter::User(f) => f.set(),
            Setter::Outcome(tx, v) => tx.send(v),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_concurrent_awaits_complete_with_exact_resources() {
    const N: usize = 1000;
    let mut rng = StdRng::seed_from_u64(seed());
    let drops = Arc::new(AtomicUsize::new(0));
    let mut setters = Vec::with_capacity(N);
    let mut expected = Vec::with_capacity(N);
    let mut tasks = Vec::with_capacity(N);
    for id in 0..N {
        let len = rng.random_range(1..256);
        let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let value: u64 = rng.random();
        expected.push((bytes.clone(), value));
        let owned = Owned {
            id,
            bytes,
            _count: Counted(drops.clone()),
        };
        match id % 3 {
            0 => {
                let flag = CompletionFlag::new();
                setters.push(Setter::Flag(flag.clone()));
                let op = InFlight::new("flag op", flag, owned);
                tasks.push(tokio::spawn(async move {
                    let (r, polls) = count_polls(op.into_future()).await;
                    (r.unwrap(), None, polls)
                }));
            }
            1 => {
                let fence = UserFence::default();
                setters.push(Setter::User(fence.clone()));
                let op = InFlight::new("user op", fence, owned);
                tasks.push(tokio::spawn(async move {
                    let (r, polls) = count_polls(op.into_future()).await;
                    (r.unwrap(), None, polls)
                }));
            }
            _ => {
                let (tx, rx) = Outcome::pair();
                setters.push(Setter::Outcome(tx, value));
                let op = InFlight::new("outcome op", rx, owned);
                tasks.push(tokio::spawn(async move {
                    let (r, polls) = count_polls(op.with_outcome()).await;
                    let (owned, v) = r.unwrap();
                    (owned, Some(v), polls)
                }));
            }
        }
    }
    // Let every task register before anything completes.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    setters.shuffle(&mut rng);
    let setter = std::thread::spawn(move || {
        for chunk in setters.chunks_mut(37) {
            for s in chunk.iter_mut() {
                std::mem::replace(s, Setter::Flag(CompletionFlag::new())).set();
            }
            std::thread::sleep(Duration::from_micros(300));
        }
    });
    let mut outputs = Vec::with_capacity(N);
    for t in tasks {
        outputs.push(
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("every await completes")
                .unwrap(),
        );
    }
    setter.join().unwrap();
    assert_eq!(
        drops.load(Ordering::SeqCst),
        0,
        "nothing freed while handed back"
    );
    let mut max_polls = 0;
    for (i, (owned, value, polls)) in outputs.into_iter().enumerate() {
        assert_eq!(owned.id, i, "each task gets its own operation's resources");
        assert_eq!(owned.bytes, expected[i].0, "exact bytes of operation {i}");
        if i % 3 == 2 {
            assert_eq!(
                value,
                Some(expected[i].1),
                "the result sent for operation {i}"
            );
        }
        max_polls = max_polls.max(polls);
    }
    // Registered once, woken once by completion (a spurious wake or two at most).
    assert!(max_polls <= 4, "a future was polled {max_polls} times");
    assert_eq!(drops.load(Ordering::SeqCst), N, "each dropped exactly once");
}

/// Drop `fut` after polling it `polls` times (with a no-op waker).
fn poll_and_drop<F: Future + Unpin>(mut fut: F, polls: usize) {
    for _ in 0..polls {
        assert!(poll_once(&mut fut).is_pending());
    }
    drop(fut);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancellation_at_every_await_point_loses_nothing_and_frees_nothing_early() {
    let drops = Arc::new(AtomicUsize::new(0));
    let owned = |id| Owned {
        id,
        bytes: vec![id as u8; 8],
        _count: Counted(drops.clone()),
    };
    let mut flags = Vec::new();
    let mut users = Vec::new();
    let flag = |flags: &mut Vec<CompletionFlag>| {
        let f = CompletionFlag::new();
        flags.push(f.clone());
        f
    };
    let user = |users: &mut Vec<UserFence>| {
        let f = UserFence::default();
        users.push(f.clone());
        f
    };
    let mut cancelled = 0;
    // Never polled.
    poll_and_drop(
        InFlight::new("a", flag(&mut flags), owned(0)).into_future(),
        0,
    );
    poll_and_drop(
        InFlight::new("b", user(&mut users), owned(1)).into_future(),
        0,
    );
    cancelled += 2;
    // Polled once and twice: registered with the flag, or with the completion thread.
    for polls in [1, 2] {
        poll_and_drop(
            InFlight::new("c", flag(&mut flags), owned(2)).into_future(),
            polls,
        );
        poll_and_drop(
            InFlight::new("d", user(&mut users), owned(3)).into_future(),
            polls,
        );
        cancelled += 2;
    }
    // With a deadline armed on the completion thread.
    poll_and_drop(
        InFlight::new("e", flag(&mut flags), owned(4)).timeout(Duration::from_secs(60)),
        1,
    );
    poll_and_drop(
        InFlight::new("f", user(&mut users), owned(5))
            .deadline(Instant::now() + Duration::from_secs(60)),
        1,
    );
    cancelled += 2;
    // An outcome that is never sent before the drop.
    let (tx, rx) = Outcome::<u64>::pair();
    poll_and_drop(InFlight::new("g", rx, owned(6)).with_outcome(), 1);
    cancelled += 1;
    // Dropped by the runtime: a select that a timer wins, a timeout wrapper, an aborted task.
    let op = InFlight::new("h", flag(&mut flags), owned(7));
    tokio::select! {
        biased;
        _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        _ = op => panic!("not complete"),
    }
    let op = InFlight::new("i", user(&mut users), owned(8));
    assert!(
        tokio::time::timeout(Duration::from_millis(5), op)
            .await
            .is_err()
    );
    let op = InFlight::new("j", flag(&mut flags), owned(9));
    let task = tokio::spawn(async move { op.await.map(|o| o.id) });
    tokio::time::sleep(Duration::from_millis(5)).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    cancelled += 3;
    // Nothing is freed while the fences are unset, however often the tracker is reaped.
    for _ in 0..5 {
        Tracker::global().reap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(drops.load(Ordering::SeqCst), 0, "freed before completion");
    // A future dropped after completion but before it was polled again frees at once.
    let f = CompletionFlag::new();
    let mut fut = InFlight::new("k", f.clone(), owned(10)).into_future();
    assert!(poll_once(&mut fut).is_pending());
    f.set();
    drop(fut);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        1,
        "complete at the drop: freed there"
    );
    // Completion: every cancelled operation's resources are freed exactly once, by reaps.
    for f in &flags {
        f.set();
    }
    for u in &users {
        u.set();
    }
    tx.send(1);
    reap_until(&drops, cancelled + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_deadline_is_typed_and_the_resources_come_back_through_the_tracker() {
    let drops = Arc::new(AtomicUsize::new(0));
    let owned = |id| Owned {
        id,
        bytes: vec![7; 4],
        _count: Counted(drops.clone()),
    };
    let flag = CompletionFlag::new();
    let user = UserFence::default();
    let (tx, rx) = Outcome::<u64>::pair();
    let t = Instant::now();
    let (a, b, c) = tokio::join!(
        InFlight::new("flag op", flag.clone(), owned(0)).timeout(Duration::from_millis(30)),
        InFlight::new("user op", user.clone(), owned(1))
            .deadline(Instant::now() + Duration::from_millis(40)),
        InFlight::new("outcome op", rx, owned(2))
            .with_outcome()
            .timeout(Duration::from_millis(50)),
    );
    assert!(t.elapsed() >= Duration::from_millis(50));
    for (r, what, at_least) in [
        (a.map(|_| ()), "flag op", 30),
        (b.map(|_| ()), "user op", 40),
        (c.map(|_| ()), "outcome op", 50),
    ] {
        match r {
            Err(Error::Timeout { what: w, after }) => {
                assert_eq!(w, what);
                assert!(
                    after >= Duration::from_millis(at_least),
                    "{what}: {after:?}"
                );
                assert!(after < Duration::from_secs(5), "{what}: {after:?}");
            }
            other => panic!("{what}: expected a timeout, got {other:?}"),
        }
    }
    assert!(Tracker::global().parked() >= 3, "parked in the tracker");
    for _ in 0..3 {
        Tracker::global().reap();
    }
    assert_eq!(
        drops.load(Ordering::SeqCst),
        0,
        "never freed before completion"
    );
    flag.set();
    user.set();
    tx.send(5);
    reap_until(&drops, 3);
    // A deadline already past still hands back a completed operation's resources.
    let done = CompletionFlag::new();
    done.set();
    let r = InFlight::new("done op", done, 3u32)
        .deadline(Instant::now() - Duration::from_millis(1))
        .await;
    assert_eq!(r.unwrap(), 3);
}

/// Completes its inner flag the moment it is first asked, after answering "not yet": from
/// another thread (so that the set races with the future's registration), or at once (so that
/// completion falls exactly between the future's first look and its registration). Wakes either
/// by itself or through the completion thread.
struct Racy {
    inner: CompletionFlag,
    asked: Arc<AtomicBool>,
    inline: bool,
    own_waker: bool,
}

impl Fence for Racy {
    fn is_complete(&self) -> bool {
        let done = self.inner.is_complete();
        if !self.asked.swap(true, Ordering::AcqRel) && self.inline {
            self.inner.set();
        }
        done
    }
    fn register_waker(&self, waker: &Waker) -> bool {
        self.own_waker && self.inner.register_waker(waker)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_wake_up_is_lost_when_completion_races_the_registration() {
    const ROUNDS: usize = 3000;
    let mut rng = StdRng::seed_from_u64(seed());
    for (inline, own_waker) in [(true, true), (true, false), (false, true), (false, false)] {
        for round in 0..ROUNDS {
            let flag = CompletionFlag::new();
            let asked = Arc::new(AtomicBool::new(false));
            let spins: u32 = rng.random_range(0..400);
            let setter = (!inline).then(|| {
                let (flag, asked) = (flag.clone(), asked.clone());
                std::thread::spawn(move || {
                    while !asked.load(Ordering::Acquire) {
                        std::hint::spin_loop();
                    }
                    for _ in 0..spins {
                        std::hint::spin_loop();
                    }
                    flag.set();
                })
            });
            let op = InFlight::new(
                "racy op",
                Racy {
                    inner: flag,
                    asked,
                    inline,
                    own_waker,
                },
                round,
            );
            // A lost wake-up would end only when the timeout's own timer re-polls the future
            // (which then finds it complete): so the time taken is what tells.
            let t = Instant::now();
            let got = tokio::time::timeout(Duration::from_secs(10), op).await;
            let lost =
                format!("wake-up lost in round {round} (inline {inline}, own waker {own_waker})");
            assert!(t.elapsed() < Duration::from_secs(5), "{lost}");
            assert_eq!(got.expect(&lost).unwrap(), round);
            if let Some(s) = setter {
                s.join().unwrap();
            }
        }
    }
}
