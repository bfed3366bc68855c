//! Threads of the daemon sleep until they have work: a session's reader is not woken each
//! time its client reads an event, and a ring thread does not spin beside a client that
//! does not read its answers. (Its own test binary, one test at a time: each finds the
//! daemon's threads among the process's by name, and another test's daemon would have the
//! same names.)

mod common;

use common::*;
use rcm::remote::Op;
use rcm_ucm::proto::{Answer, Command, Message, WireEvent};

/// Held by each test for its whole run (taken first, so its daemon is gone when it is let go).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The ids of this process's threads named `name`.
fn threads_named(name: &str) -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|e| {
            let tid = e.ok()?.file_name().into_string().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
            (comm.trim_end() == name).then_some(tid)
        })
        .collect()
}

/// How often thread `tid` of this process has gone to sleep.
fn sleeps(tid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("voluntary_ctxt_switches")
}

/// A Unix stream socket has one wait queue for readers and writers, and the kernel wakes it
/// ("writable") each time the peer takes data this side sent: a reader asleep in `recv`
/// wakes for that, finds nothing, and sleeps again. The daemon writes a session's events on
/// the connection its reader sleeps on, so the reader must sleep in a way that only input
/// ends (`poll` for input). Here 200 events go out on the session's connection (their
/// commands come on a channel) and are read one at a time; the session's reader has nothing
/// to do meanwhile and must stay asleep.
#[test]
fn session_reader_sleeps_while_its_events_are_read() {
    const EVENTS: u32 = 200;
    let _one = one_at_a_time();
    let d = daemon("wake-reader", 47400, &[1]);
    let (mut s, token) = raw(&d);
    // The first session of this daemon: its reader thread is `rcm-ucm-r1`.
    let reader = threads_named("rcm-ucm-r1");
    assert_eq!(reader.len(), 1, "one session reader: {reader:?}");
    let reader = &reader[0];
    // Credit for every event, given before counting.
    s.send(&Command::GetEvent(EVENTS)).expect("credit");
    let mut c = channel(&d, token);
    // Let the reader take the credit and fall asleep.
    wait_stats(&mut c, |st| st.credit == u64::from(EVENTS), "the credit");
    std::thread::sleep(std::time::Duration::from_millis(50));
    let before = sleeps(reader);
    for _ in 0..EVENTS {
        let h = create(&mut c);
        ok(
            &mut c,
            &Command::Call(
                h,
                Op::ResolveAddr {
                    src: None,
                    dst: nowhere(),
                },
            ),
        );
        match s.next_event().expect("event") {
            Message::Event { handle, event, .. } => {
                assert_eq!(handle, h);
                assert!(matches!(event, WireEvent::AddrError(_)), "event {event:?}");
            }
            m => panic!("not an event: {m:?}"),
        }
        ok(&mut c, &Command::DestroyId(h));
    }
    let woken = sleeps(reader) - before;
    // Without the poll the reader woke once per event read (200 here).
    assert!(
        woken < u64::from(EVENTS) / 10,
        "the session reader woke {woken} times while {EVENTS} events were read"
    );
    // It still wakes for input: the session answers.
    assert!(matches!(
        s.call(&Command::Stats).expect("stats"),
        Message::Ok(Answer::Stats(_))
    ));
}

/// CPU time (user and system, in clock ticks) thread `tid` of this process has used.
fn cpu_ticks(tid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("stat");
    // The fields after the command (which is in parentheses and may hold spaces): utime and
    // stime are the 12th and 13th of them.
    let rest = stat.rsplit_once(')').expect("a command field").1;
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|v| v.parse().expect("a number"))
        .collect();
    f.iter().sum()
}

/// A client that pushes more commands on a mapped channel than its answer ring holds and
/// never reads them: its channel waits (the ring thread retries the answer now and then),
/// and the ring thread, with nothing else to do, sleeps meanwhile. It spun instead: the
/// unread command behind the waiting answer kept it from sleeping, a whole CPU for as long
/// as the client sat there.
#[test]
fn a_client_that_does_not_read_its_answers_keeps_no_ring_thread_busy() {
    use rcm_shm::{Consumer, Producer};
    use rcm_ucm::shmchan::{ANSWERS, COMMANDS};
    let _one = one_at_a_time();
    let mut cfg = config("wake-unread", 47401, &[1]);
    cfg.ring_threads = 1;
    let d = rcm_ucm::Daemon::start(cfg).expect("daemon");
    let (_s, token) = raw(&d);
    let mut c = channel(&d, token);
    let (m, region) = c.map_channel().expect("map");
    assert!(matches!(m, Message::Ok(Answer::Reply(_))), "mapped: {m:?}");
    let region = std::sync::Arc::new(region.expect("the memory came with the answer"));
    let mut tx = Producer::new(region.clone(), COMMANDS).expect("producer");
    let rx = Consumer::new(region, ANSWERS).expect("consumer");
    push_unanswered(&mut tx, &mut c, 2500);
    wait_until(|| rx.has_data(), || "no answer came".into());
    let ring = threads_named("rcm-ucm-rings0");
    assert_eq!(ring.len(), 1, "one ring thread: {ring:?}");
    // Past the ring thread's spin (100 µs) and its answers' filling the ring.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let before = cpu_ticks(&ring[0]);
    let t = std::time::Instant::now();
    std::thread::sleep(std::time::Duration::from_secs(1));
    let used = cpu_ticks(&ring[0]) - before;
    // /proc counts in USER_HZ, 1/100 s on Linux: a spinning thread used ~100.
    let wall = (t.elapsed().as_secs_f64() * 100.0) as u64;
    assert!(
        used * 5 < wall,
        "the ring thread used {used} of {wall} clock ticks while its only client read nothing"
    );
    // The channel still goes on once the client reads: the first answer is there.
    let mut rx = rx;
    let (seq, m) = next_frame(&mut rx);
    assert_eq!(seq, 1);
    assert!(matches!(m, Message::Ok(Answer::Devices(_))), "{m:?}");
}

/// A session whose events are mapped and whose client sends commands without reading that
/// ring: the replies fill it, and the session's reader waits for room, looking again less
/// and less often. It looked every 100 µs for as long as the client sat there.
#[test]
fn a_reader_waiting_for_room_in_an_unread_events_ring_mostly_sleeps() {
    let _one = one_at_a_time();
    let d = daemon("wake-full", 47402, &[1]);
    let (mut s, _token) = raw(&d);
    let (m, region) = s.map_events().expect("map events");
    assert!(matches!(m, Message::Ok(Answer::Reply(_))), "mapped: {m:?}");
    let rx = rcm_shm::Consumer::new(
        std::sync::Arc::new(region.expect("the memory came with the answer")),
        rcm_ucm::shmchan::EVENTS,
    )
    .expect("consumer");
    let reader = threads_named("rcm-ucm-r1");
    assert_eq!(reader.len(), 1, "one session reader: {reader:?}");
    // About 8,000 replies (32 bytes each) fill the 256 KiB ring; the commands behind them
    // wait in the socket's buffer.
    // The reader stops reading commands while it waits: a send that finds the socket's
    // buffer full ends the loop.
    s.stream()
        .set_write_timeout(Some(std::time::Duration::from_millis(500)))
        .expect("timeout");
    let mut sent = 0;
    while sent < 9000 && s.send(&Command::Devices).is_ok() {
        sent += 1;
    }
    wait_until(|| rx.has_data(), || "no reply came".into());
    // Past the ramp of its waits (100 µs doubling to 10 ms: ~20 ms).
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before = sleeps(&reader[0]);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let woke = sleeps(&reader[0]) - before;
    assert!(
        woke < 1000,
        "the session reader woke {woke} times in a second while its ring stayed full \
         ({sent} commands sent)"
    );
    assert!(woke > 0, "the reader stopped looking for room");
}
