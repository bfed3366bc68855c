//! `rcm bench` and `rcm ping` with `--transport iwarp`: iWARP devices (MPA over TCP) on
//! loopback, run as the binary. Each test has its own TCP (rdma_cm) and UDP ports in
//! 28010..=28029.

use std::process::{Command, Stdio};

mod common;

use common::rcm;

#[test]
fn bench_iwarp_local_runs_every_cmtime_step() {
    let (code, out, err) = rcm(&[
        "bench",
        "--transport",
        "iwarp",
        "-c",
        "100",
        "-p",
        "28010",
        "--udp-port",
        "28011",
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    for step in [
        "create id",
        "resolve addr",
        "resolve route",
        "cm connect",
        "establish",
        "disconnect",
        "destroy id",
    ] {
        assert!(out.contains(step), "missing step {step}: {out}");
    }
    assert!(out.contains("established 100/100  errors 0"), "{out}");
}

#[test]
fn bench_iwarp_serial() {
    let (code, out, err) = rcm(&[
        "bench",
        "--transport",
        "iwarp",
        "--serial",
        "-c",
        "10",
        "-p",
        "28012",
        "--udp-port",
        "28013",
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("established 10/10  errors 0"), "{out}");
}

#[test]
fn ping_iwarp_both_roles_exchanges_private_data_and_messages() {
    let (code, out, err) = rcm(&[
        "ping",
        "--transport",
        "iwarp",
        "-c",
        "3",
        "-p",
        "28014",
        "--udp-port",
        "28015",
        "--private-data",
        "iw-data",
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(
            "both: 3 of 3 established, 3 disconnected, 0 rejected, private data matched 6 time(s)"
        ),
        "{out}"
    );
    assert!(
        out.contains("message exchanged: sent \"ping iw-data\", received \"pong iw-data\""),
        "{out}"
    );
    assert!(
        out.contains("messages over the iWARP stream received 6 of 6 (6 checked byte for byte, 0 from a peer not in rcm's format)"),
        "{out}"
    );
}

/// More connections at once than the default backlog (1,024): the server listens with a
/// backlog of its count, so none is refused (past 1,024, 472 of 1,500 were).
#[test]
fn ping_iwarp_more_connections_than_the_default_backlog() {
    let (code, out, err) = rcm(&[
        "ping",
        "--transport",
        "iwarp",
        "-c",
        "1500",
        "-p",
        "28040",
        "--udp-port",
        "28041",
        "--timeout",
        "60",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("both: 1500 of 1500 established, 1500 disconnected, 0 rejected"),
        "{out}"
    );
}

/// An `rcm ping --listen` process, started and read up to its "listening on" line: a client
/// started earlier could have a connection refused. Killed if the test ends before `finish`.
struct PingServer {
    child: Option<std::process::Child>,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    out: String,
}

impl PingServer {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rcm"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start server");
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(
            child.stdout.take().expect("server stdout"),
        ));
        let mut out = String::new();
        for line in lines.by_ref() {
            let line = line.expect("server output");
            out.push_str(&line);
            out.push('\n');
            if line.contains("listening on") {
                break;
            }
        }
        PingServer {
            child: Some(child),
            lines,
            out,
        }
    }

    /// Waits for the server to exit: its status, all it printed, its stderr.
    fn finish(mut self) -> (Option<i32>, String, String) {
        for line in self.lines.by_ref() {
            self.out.push_str(&line.expect("server output"));
            self.out.push('\n');
        }
        let child = self.child.take().expect("running");
        let s = child.wait_with_output().expect("server exits");
        let err = String::from_utf8_lossy(&s.stderr).into_owned();
        (s.status.code(), std::mem::take(&mut self.out), err)
    }
}

impl Drop for PingServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn ping_iwarp_split_server_and_client() {
    // The client starts once the server listens: a client started earlier could have one
    // connection refused and the other served, and the server would count one too many.
    let server = PingServer::start(&[
        "ping",
        "--transport",
        "iwarp",
        "--listen",
        "--bind",
        "127.0.0.1",
        "-c",
        "2",
        "-p",
        "28016",
        "--udp-port",
        "28017",
        "--timeout",
        "30",
    ]);
    let (code, cout, cerr) = rcm(&[
        "ping",
        "--transport",
        "iwarp",
        "--connect",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
        "-c",
        "2",
        "-p",
        "28016",
        "--udp-port",
        "28018",
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 0, "{cout}\n{cerr}");
    let (status, sout, _) = server.finish();
    assert_eq!(status, Some(0), "{sout}");
    assert!(
        cout.contains("client: 2 of 2 established, 2 disconnected"),
        "{cout}"
    );
    assert!(
        cout.contains("messages over the iWARP stream received 2 of 2 (2 checked byte for byte, 0 from a peer not in rcm's format)"),
        "{cout}"
    );
    assert!(
        sout.contains("server: 2 of 2 established, 2 disconnected"),
        "{sout}"
    );
    assert!(
        sout.contains("messages over the iWARP stream received 2 of 2 (2 checked byte for byte, 0 from a peer not in rcm's format)"),
        "{sout}"
    );
}

#[test]
fn ping_iwarp_reject_carries_private_data() {
    let (code, out, err) = rcm(&[
        "ping",
        "--transport",
        "iwarp",
        "--reject",
        "-p",
        "28019",
        "--udp-port",
        "28020",
        "--private-data",
        "nope",
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("rejected, reason 28 (ConsumerDefined)"),
        "{out}"
    );
    assert!(
        out.contains("1 rejected, private data matched 2 time(s)"),
        "{out}"
    );
}

#[test]
fn ping_iwarp_without_server_is_rejected() {
    // Nobody listens on TCP 127.0.0.1:28021: the RST is IB's "invalid service ID" (8).
    let (code, out, _) = rcm(&[
        "ping",
        "--transport",
        "iwarp",
        "--connect",
        "127.0.0.1",
        "-p",
        "28021",
        "--udp-port",
        "28022",
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("rejected, reason 8 (InvalidServiceId)"),
        "{out}"
    );
}

#[test]
fn ping_iwarp_usage_errors() {
    let (code, _, err) = rcm(&["ping", "--transport", "iwarp", "--ps", "udp", "-p", "28023"]);
    assert_eq!(code, 2);
    assert!(err.contains("iWARP"), "{err}");
    let long = "x".repeat(253);
    let (code, _, err) = rcm(&[
        "ping",
        "--transport",
        "iwarp",
        "-p",
        "28024",
        "--private-data",
        &long,
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("at most 252"), "{err}");
}

#[test]
fn ping_iwarp_mpa_revision_1_and_its_usage_error() {
    let (code, out, err) = rcm(&[
        "ping",
        "--transport",
        "iwarp",
        "--mpa-version",
        "1",
        "-c",
        "2",
        "-p",
        "28030",
        "--udp-port",
        "28031",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["established"], 2);
    assert_eq!(v["messages_ok"], v["messages_expected"]);
    let (code, _, err) = rcm(&["ping", "--transport", "iwarp", "--mpa-version", "3"]);
    assert_eq!(code, 2);
    assert!(err.contains("mpa-version"), "{err}");
}

/// `rcm ping --transport iwarp --listen -C 2` against a client that behaves as rdma-core's
/// `ucmatose` does: it takes all of the server's messages before it sends its own, and its
/// messages are its buffer (100 bytes, not rcm's format; it sends no private data, so the
/// server expects none, as in the interop run). The server sends both of its
/// messages before waiting (a server that sent one and waited for an answer waited 10 s for
/// each, then failed with "no message from the peer"), counts the client's as not in rcm's
/// format, and exits 0.
#[test]
fn ping_iwarp_server_serves_a_ucmatose_like_client() {
    use rcm::{ConnectOptions, EventChannel, Fabric, FabricConfig, PortSpace};
    use std::time::{Duration, Instant};
    let server = PingServer::start(&[
        "ping",
        "--transport",
        "iwarp",
        "--listen",
        "--bind",
        "127.0.0.1",
        "-c",
        "1",
        "-C",
        "2",
        "-p",
        "28025",
        "--private-data",
        "",
        "--timeout",
        "30",
    ]);
    let f = Fabric::new(FabricConfig::default());
    f.add_iwarp_device("127.0.0.2".parse().unwrap()).unwrap();
    let ch = EventChannel::new();
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    id.resolve_addr(None, "127.0.0.1:28025".parse().unwrap())
        .unwrap();
    let t = Duration::from_secs(10);
    let next = |what: &str| {
        let e = ch.get_event(Some(t)).unwrap_or_else(|| panic!("no {what}"));
        e.event().name().to_string()
    };
    assert_eq!(next("ADDR_RESOLVED"), "ADDR_RESOLVED");
    id.resolve_route().unwrap();
    assert_eq!(next("ROUTE_RESOLVED"), "ROUTE_RESOLVED");
    id.connect(&ConnectOptions::default()).unwrap();
    assert_eq!(next("ESTABLISHED"), "ESTABLISHED");
    // ucmatose's client: receive everything first (5 s each is plenty on loopback), then
    // answer with its buffer.
    let t0 = Instant::now();
    for k in 0..2 {
        let m = id.recv_message(Duration::from_secs(5));
        assert_eq!(
            m.as_deref(),
            Some(b"pong ".as_slice()),
            "server message {k}"
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for _ in 0..2 {
        id.send(&[0xA5; 100]).unwrap();
    }
    assert_eq!(next("DISCONNECTED"), "DISCONNECTED");
    id.destroy().unwrap();
    let (status, sout, serr) = server.finish();
    assert_eq!(status, Some(0), "{sout}{serr}");
    assert!(
        sout.contains(
            "messages over the iWARP stream received 2 of 2 (0 checked byte for byte, 2 from a peer not in rcm's format)"
        ),
        "{sout}"
    );
}
