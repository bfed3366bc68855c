//! A client that writes without pause on its mapped channel's socket (where a doorbell is one
//! byte) must not hold the daemon's ring thread: the thread drained such a socket until it
//! was empty, so other clients' mapped channels served by it got no answer and the daemon's
//! shutdown, which joins that thread, never finished while the flood went on.

mod common;

use common::*;
use rcm::remote::Reply;
use rcm_shm::{Consumer, Producer, Region};
use rcm_ucm::proto::{Answer, Command, Header, Message};
use rcm_ucm::raw::RawSession;
use rcm_ucm::shmchan::{ANSWERS, COMMANDS};
use rcm_ucm::Daemon;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A mapped command channel of the session `token`: its socket and both rings.
fn mapped(d: &Daemon, token: u64) -> (RawSession, Producer, Consumer) {
    let mut c = channel(d, token);
    let (m, region) = c.map_channel().expect("map");
    assert_eq!(m, Message::Ok(Answer::Reply(Reply::Done)), "mapped");
    let region = Arc::new(region.expect("memory"));
    let tx = Producer::new(region.clone(), COMMANDS).expect("producer");
    let rx = Consumer::new(region as Arc<Region>, ANSWERS).expect("consumer");
    (c, tx, rx)
}

/// One call through the rings, rung for when the daemon sleeps: answered within `T`?
fn answered(tx: &mut Producer, rx: &mut Consumer, bell: &mut RawSession, seq: u32) -> bool {
    let t0 = Instant::now();
    if tx
        .push(&Command::Devices.encode(seq))
        .expect("push")
        .expect("room")
    {
        bell.send_bytes(&[1]).expect("doorbell");
    }
    let mut f = Vec::new();
    while !rx.pop(&mut f, 1 << 20).expect("pop") {
        if t0.elapsed() > T {
            return false;
        }
        std::thread::yield_now();
    }
    let h = Header::parse(f.first_chunk::<12>().expect("a header")).expect("header");
    assert_eq!(h.seq, seq);
    true
}

#[test]
fn a_client_flooding_its_doorbell_holds_up_no_one_else_nor_the_shutdown() {
    let mut cfg = config("bell-flood", 49131, &[1]);
    cfg.ring_threads = 1;
    let d = Daemon::start(cfg).expect("daemon");
    let (_victim, victim_token) = raw(&d);
    let (mut vbell, mut vtx, mut vrx) = mapped(&d, victim_token);
    assert!(
        answered(&mut vtx, &mut vrx, &mut vbell, 1),
        "before the flood"
    );
    // Three other clients' mapped channels, their sockets written to without pause (with a
    // large send buffer where allowed, root only, so the socket is never found empty).
    let stop = Arc::new(AtomicBool::new(false));
    let mut held = Vec::new();
    let mut flooders = Vec::new();
    for _ in 0..3 {
        let (s, token) = raw(&d);
        let (bell, tx, rx) = mapped(&d, token);
        let stream = bell.stream().try_clone().expect("clone");
        let _ = rustix::net::sockopt::set_socket_send_buffer_size_force(&stream, 8 << 20);
        let stop = stop.clone();
        flooders.push(std::thread::spawn(move || {
            use std::io::Write;
            let buf = vec![1u8; 256 * 1024];
            let mut w = &stream;
            while !stop.load(Ordering::Relaxed) && w.write_all(&buf).is_ok() {}
        }));
        held.push((s, bell, tx, rx));
    }
    std::thread::sleep(Duration::from_millis(200));
    let unanswered = (2..=41).find(|&k| !answered(&mut vtx, &mut vrx, &mut vbell, k));
    // The shutdown, with the flood still on.
    let (done_tx, done) = std::sync::mpsc::channel();
    let stopper = std::thread::spawn(move || {
        d.shutdown();
        let _ = done_tx.send(());
    });
    let stopped = done.recv_timeout(T).is_ok();
    stop.store(true, Ordering::Relaxed);
    for (_, bell, _, _) in &held {
        let _ = bell.stream().shutdown(std::net::Shutdown::Both);
    }
    for f in flooders {
        let _ = f.join();
    }
    let _ = stopper.join();
    assert_eq!(
        unanswered, None,
        "another client's doorbell flood kept the ring thread from answering this call"
    );
    assert!(
        stopped,
        "the daemon's shutdown did not finish during the flood"
    );
}
