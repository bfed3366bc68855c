//! Writing to a peer that went away is an error, never a `SIGPIPE`: the client library and
//! an embedded daemon run inside host programs, which may have the signal's default action
//! (terminate). This test binary restores that default, so a write without `MSG_NOSIGNAL`
//! to a closed connection kills it and the test fails.

mod common;

use common::*;
use rcm_ucm::proto::{self, Command, Limits, Message};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};

fn default_sigpipe() {
    // SAFETY: sets a signal's disposition to the default action; no handler is installed,
    // so nothing of this program runs in signal context.
    let old = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    assert_ne!(old, libc::SIG_ERR);
}

fn hello_frame() -> Vec<u8> {
    Command::Hello {
        min: proto::VERSION,
        max: proto::VERSION,
    }
    .encode(1)
}

#[test]
fn a_client_whose_daemon_hung_up_gets_an_error() {
    default_sigpipe();
    // A "daemon" that stops reading before it answers the Hello: the client's next write
    // (its event credit) goes to a connection whose peer will read no more, which is EPIPE.
    let path = sock("sigpipe-client");
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).expect("bind");
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let mut hello = vec![0u8; hello_frame().len()];
        s.read_exact(&mut hello).expect("hello");
        s.shutdown(std::net::Shutdown::Read).expect("shutdown");
        let ok = Message::HelloOk {
            version: proto::VERSION,
            token: 7,
            limits: Limits::default(),
        }
        .encode(1);
        s.write_all(&ok).expect("hello ok");
        // Kept open until the client is done.
        s
    });
    let r = rcm_ucm::Client::connect(&path);
    assert!(r.is_err(), "the credit went to a peer that reads no more");
    drop(server.join().expect("server"));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_daemon_whose_client_hung_up_keeps_serving() {
    default_sigpipe();
    let d = daemon("sigpipe-daemon", 47801, &[1, 2]);
    // Each client sends a Hello and hangs up before the answer: the daemon's answer goes
    // to a closed connection.
    for _ in 0..50 {
        let mut s = UnixStream::connect(d.socket()).expect("connect");
        s.write_all(&hello_frame()).expect("hello");
        drop(s);
    }
    wait_until(
        || d.sessions() == 0,
        || format!("{} sessions left", d.sessions()),
    );
    round_trip(&d, sa(1, 7801));
}
