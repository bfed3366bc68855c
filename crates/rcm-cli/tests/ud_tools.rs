//! `rcm ping --ps udp` with UD datagrams, as a user runs it: rcm against rcm (both roles in
//! one process, and two processes), SIDR only (`--messages 0`), and against in-test peers that
//! behave as rdma-core's udaddy does (a client sending an unchecked buffer with its QPN as
//! immediate data, a server answering with its receive buffer). UDP ports 28120..=28139.

use rcm::{AcceptOptions, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, PortSpace};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

mod common;

use common::rcm;

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rcm")
}

fn finish(c: Child) -> (i32, String, String) {
    let out = c.wait_with_output().expect("wait rcm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(out: &str) -> serde_json::Value {
    let line = out.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn both_roles_exchange_udaddy_s_default_ten_datagrams_checked_byte_for_byte() {
    let (code, out, err) = rcm(&[
        "ping",
        "--ps",
        "udp",
        "-c",
        "3",
        "--udp-port",
        "28120",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v = json(&out);
    assert_eq!(v["established"], 3);
    // 10 datagrams per connection each way (server receives 10, client 10 answers).
    assert_eq!(v["messages_expected"], 60);
    assert_eq!(v["messages_ok"], 60);
    assert_eq!(v["messages_unverified"], 0);
    assert_eq!(v["errors"].as_array().map(Vec::len), Some(0));

    // The text report says so too.
    let (code, out, err) = rcm(&[
        "ping",
        "--ps",
        "udp",
        "-C",
        "2",
        "-S",
        "33",
        "--udp-port",
        "28121",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("UD datagrams received 4 of 4 (4 checked byte for byte, 0 from a peer"),
        "{out}"
    );
    assert!(out.contains("sent 2 UD datagrams of 33 bytes"), "{out}");
}

#[test]
fn server_and_client_processes_exchange_datagrams() {
    let srv = spawn(&[
        "ping",
        "--ps",
        "udp",
        "--listen",
        "-c",
        "2",
        "--messages",
        "4",
        "--udp-port",
        "28122",
        "--timeout",
        "30",
        "--json",
    ]);
    std::thread::sleep(Duration::from_millis(300));
    let (code, out, err) = rcm(&[
        "ping",
        "--ps",
        "udp",
        "--connect",
        "127.0.0.1",
        "-c",
        "2",
        "--messages",
        "4",
        "--udp-port",
        "28122",
        "--timeout",
        "30",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let c = json(&out);
    assert_eq!(
        (c["messages_ok"].as_u64(), c["messages_expected"].as_u64()),
        (Some(8), Some(8))
    );
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{out}\n{err}");
    let s = json(&out);
    assert_eq!(
        (s["messages_ok"].as_u64(), s["messages_expected"].as_u64()),
        (Some(8), Some(8))
    );
    assert_eq!(s["established"], 2);
}

#[test]
fn messages_zero_is_sidr_only_and_bad_options_are_refused() {
    for flag in [&["--messages", "0"][..], &["--no-messages"][..]] {
        let mut a = vec![
            "ping",
            "--ps",
            "udp",
            "-c",
            "2",
            "--udp-port",
            "28124",
            "--json",
        ];
        a.extend_from_slice(flag);
        let (code, out, err) = rcm(&a);
        assert_eq!(code, 0, "{out}\n{err}");
        let v = json(&out);
        assert_eq!(v["established"], 2);
        assert_eq!(v["messages_expected"], 0);
    }
    // Datagrams do not go through a daemon; sizes a datagram cannot carry.
    let (code, _, err) = rcm(&[
        "ping",
        "--ps",
        "udp",
        "--daemon",
        "/nonexistent.sock",
        "--messages",
        "3",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("not carried through the daemon"), "{err}");
    for size in ["0", "4097"] {
        let (code, _, err) = rcm(&["ping", "--ps", "udp", "--size", size, "--udp-port", "28125"]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("--size"), "{err}");
    }
}

#[test]
fn a_server_missing_datagrams_says_so() {
    // The client sends 3; the server waits for 5 (its wait is 10 s) and fails, naming the
    // shortfall; the client got its 3 answers.
    let srv = spawn(&[
        "ping",
        "--ps",
        "udp",
        "--listen",
        "-c",
        "1",
        "--messages",
        "5",
        "--udp-port",
        "28126",
        "--timeout",
        "30",
    ]);
    std::thread::sleep(Duration::from_millis(300));
    let (code, out, err) = rcm(&[
        "ping",
        "--ps",
        "udp",
        "--connect",
        "127.0.0.1",
        "--messages",
        "3",
        "--udp-port",
        "28126",
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let (code, out, _) = finish(srv);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("received 3 of 5 UD datagrams"), "{out}");
}

fn fabric(port: u16, ip: [u8; 4]) -> Fabric {
    let f = Fabric::new(FabricConfig {
        udp_port: port,
        ..FabricConfig::default()
    });
    f.add_device(IpAddr::from(ip)).expect("device");
    f
}

/// An in-test server doing what `udaddy -b IP -C 5 -S 100` does: accept the SIDR_REQ,
/// receive 5 datagrams, then answer 5 times to the QPN in the immediate data with its
/// receive buffer (a 40-byte GRH, then the start of the last message), with its own QPN as
/// immediate data. `rcm ping --connect` counts those answers as received, not checked.
#[test]
fn rcm_client_against_a_server_that_answers_as_udaddy_does() {
    let f = fabric(28128, [127, 0, 0, 1]);
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Udp, &ch);
    l.bind(SocketAddr::new(IpAddr::from([127, 0, 0, 1]), 7174))
        .expect("bind");
    l.listen(0).expect("listen");
    let client = spawn(&[
        "ping",
        "--ps",
        "udp",
        "--connect",
        "127.0.0.1",
        "--messages",
        "5",
        "--size",
        "100",
        "--private-data",
        "",
        "--udp-port",
        "28128",
        "--timeout",
        "30",
        "--json",
    ]);
    let req = ch.get_event(Some(T)).expect("connect request");
    assert!(matches!(
        req.event(),
        Event::ConnectRequest { ud: true, .. }
    ));
    let id = req.id().clone();
    drop(req);
    id.accept(&AcceptOptions::default()).expect("accept");
    let qpn = id.qp_num().expect("QPN");
    let mut last = Vec::new();
    let mut from = None;
    for k in 0..5 {
        let m = id.recv_ud(T).expect("a datagram from rcm ping");
        assert_eq!(m.payload.len(), 100);
        assert!(
            m.payload.starts_with(format!("ping {k} ").as_bytes()),
            "{:?}",
            m.payload
        );
        assert_eq!(
            m.imm,
            Some(m.src_qpn),
            "rcm sends its QPN as immediate data, as udaddy"
        );
        last = m.payload.clone();
        from = Some((m.src, m.src_qpn));
    }
    let (src, peer_qpn) = from.expect("sender");
    let mut buf = vec![0u8; 40];
    buf.extend_from_slice(&last[..60]);
    for _ in 0..5 {
        let to = rcm::UdParam {
            qpn: peer_qpn,
            qkey: rcm_wire::cma::RDMA_UDP_QKEY,
        };
        id.send_ud_with_imm(src, to, qpn, &buf).expect("answer");
    }
    let (code, out, err) = finish(client);
    assert_eq!(code, 0, "{out}\n{err}");
    let v = json(&out);
    assert_eq!(v["messages_expected"], 5);
    assert_eq!(v["messages_unverified"], 5);
    assert_eq!(v["messages_ok"], 0);
    f.shutdown();
}

/// An in-test client doing what `udaddy -s IP -C 5 -S 100` does: SIDR, then 5 datagrams of
/// an arbitrary 100-byte buffer with its QPN as immediate data, then it waits for 5
/// answers on its QPN. `rcm ping --listen` answers each, echoing the length.
#[test]
fn rcm_server_answers_a_client_that_sends_as_udaddy_does() {
    let srv = spawn(&[
        "ping",
        "--ps",
        "udp",
        "--listen",
        "-c",
        "1",
        "--messages",
        "5",
        "--private-data",
        "",
        "--udp-port",
        "28130",
        "--timeout",
        "30",
        "--json",
    ]);
    std::thread::sleep(Duration::from_millis(300));
    let f = fabric(28130, [127, 0, 0, 2]);
    let ch = EventChannel::new();
    let c = f.create_id_on(PortSpace::Udp, &ch);
    c.resolve_addr(None, SocketAddr::new(IpAddr::from([127, 0, 0, 1]), 7174))
        .expect("resolve_addr");
    let mut ud = None;
    while ud.is_none() {
        let mut e = ch.get_event(Some(T)).expect("event");
        match e.take() {
            Some(Event::AddrResolved) => c.resolve_route().expect("route"),
            Some(Event::RouteResolved) => c.connect(&ConnectOptions::default()).expect("connect"),
            Some(Event::Established { ud: Some(u), .. }) => ud = Some(u),
            other => panic!("{other:?}"),
        }
    }
    let ud = ud.expect("resolved");
    assert_eq!(ud.qkey, rcm_wire::cma::RDMA_UDP_QKEY);
    let qpn = c.qp_num().expect("QPN");
    let garbage: Vec<u8> = (0..100u8).map(|b| b.wrapping_mul(37)).collect();
    for _ in 0..5 {
        c.send_ud_with_imm(IpAddr::from([127, 0, 0, 1]), ud, qpn, &garbage)
            .expect("send");
    }
    for _ in 0..5 {
        let m = c.recv_ud(T).expect("an answer");
        assert_eq!(m.payload, garbage, "echoed, the same length");
        assert_eq!(m.src_qpn, ud.qpn);
        assert_eq!(m.imm, Some(ud.qpn));
    }
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{out}\n{err}");
    let v = json(&out);
    assert_eq!(v["messages_expected"], 5);
    assert_eq!(v["messages_unverified"], 5);
    f.shutdown();
}
