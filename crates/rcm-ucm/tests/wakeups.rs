//! Threads of the daemon sleep until they have work: a session's reader is not woken each
//! time its client reads an event. (Its own test binary: it finds the reader among the
//! process's threads by name, and another test's daemon would have the same names.)

mod common;

use common::*;
use rcm::remote::Op;
use rcm_ucm::proto::{Answer, Command, Message, WireEvent};

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
