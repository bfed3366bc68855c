//! `rcm bench` and `rcm ping` as a user runs them (each test on a UDP port of its own, since
//! tests run in parallel and the devices bind 127.0.0.1/.2).

use std::process::Command;

mod common;

use common::rcm;

/// Starts `rcm` with `args` as a server process (stdout and stderr piped) and gives it
/// 300 ms to open its devices and listen.
fn start_server(args: &[&str]) -> std::process::Child {
    let c = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn rcm");
    std::thread::sleep(std::time::Duration::from_millis(300));
    c
}

#[test]
fn bench_json_reports_every_connection_and_the_table() {
    let dir = std::env::temp_dir().join(format!("rcm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plot = dir.join("lat.svg");
    let (code, out, err) = rcm(&[
        "bench",
        "-c",
        "300",
        "--udp-port",
        "26791",
        "--json",
        "--baseline",
        "tcp",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["connections"], 300);
    assert_eq!(v["established"], 300);
    assert_eq!(v["errors"], 0);
    assert!(v["conn_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["connect_p50_us"].as_f64().unwrap() > 0.0);
    assert!(v["connect_p99_us"].as_f64().unwrap() >= v["connect_p50_us"].as_f64().unwrap());
    assert!(v["baseline_conn_per_s"].as_f64().unwrap() > 0.0);
    let steps: Vec<&str> = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_str().unwrap())
        .collect();
    for s in [
        "full connect",
        "create id",
        "bind addr",
        "resolve addr",
        "resolve route",
        "create qp",
        "init qp attr",
        "cm connect",
        "rtr qp attr",
        "rts qp attr",
        "establish",
        "disconnect",
        "destroy id",
    ] {
        assert!(steps.contains(&s), "missing step {s}: {steps:?}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_table_and_serial_mode() {
    let (code, out, err) = rcm(&["bench", "-c", "20", "--serial", "--udp-port", "26792"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(
            "step             avg/conn    total(us)    us/conn      sum(us)    max(us)    min(us)"
        ),
        "{out}"
    );
    assert!(out.contains("mode serial"));
    assert!(out.contains("established 20/20  errors 0"), "{out}");
    // Both round trips are reported: ends sleeping, and ends polling as rcm's threads do.
    assert!(out.contains("loopback UDP RTT p50"), "{out}");
    assert!(out.contains("when both ends poll"), "{out}");
    // The waiting thread received answers itself (each REP waits on it while it polls),
    // unless rcm held it off polling beside a CPU-bound process, which the run then says.
    assert!(
        out.contains("datagrams received by the waiting thread itself")
            || out.contains("contention: "),
        "{out}"
    );
}

/// `--spin-us 0`: no thread polls; the run still completes, and the polling round trip is
/// not measured (there is no polling to compare with).
#[test]
fn bench_without_polling() {
    let (code, out, err) = rcm(&[
        "bench",
        "-c",
        "20",
        "--serial",
        "--udp-port",
        "26793",
        "--spin-us",
        "0",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(r["established"], 20, "{out}");
    assert!(r["udp_rtt_p50_us"].as_f64().unwrap() > 0.0, "{out}");
    assert_eq!(r["udp_rtt_poll_p50_us"].as_f64(), Some(0.0), "{out}");
    assert_eq!(r["udp_rtt_poll_windows"], 0, "{out}");
    // A thread that does not poll receives nothing itself.
    assert_eq!(r["busy_polled"], 0, "{out}");
    let (code, _, err) = rcm(&["bench", "--spin-us", "200000"]);
    assert_eq!(code, 2);
    assert!(err.contains("spin-us"), "{err}");
}

/// `--no-send-batch`: one datagram per system call and the server's callbacks on callback
/// threads (the default batches both); the run is the same.
#[test]
fn bench_without_send_batches() {
    // And a burst whose calls come from four threads, the callbacks on callback threads.
    for extra in [
        &[][..],
        &["--serial"][..],
        &["--issuers", "4", "--threads", "4"][..],
    ] {
        let mut args = vec![
            "bench",
            "-c",
            "200",
            "--udp-port",
            "26794",
            "--no-send-batch",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 0, "{out}\n{err}");
        let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        assert_eq!(r["established"], 200, "{out}");
        assert_eq!(r["errors"], 0, "{out}");
        let issuers = if extra.contains(&"--issuers") { 4 } else { 1 };
        assert_eq!(r["issuers"], issuers, "{out}");
        // The "full connect" row, as cmtime's: each connection's time to being up gives
        // max and min (the sum is left out: they overlap), within the row's total.
        let full = r["steps"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["step"] == "full connect"))
            .expect("a full connect row");
        let f = |k: &str| full[k].as_f64().expect(k);
        assert_eq!((f("sum_us"), f("us_per_conn")), (0.0, 0.0), "{full}");
        assert!(
            0.0 < f("min_us") && f("min_us") <= f("max_us") && f("max_us") <= f("total_us"),
            "{full}"
        );
    }
}

#[test]
fn bench_usage_errors_are_clear() {
    let (code, _, err) = rcm(&["bench", "-c", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("connections"), "{err}");
    let (code, _, err) = rcm(&["bench", "--listen", "--server", "127.0.0.1"]);
    assert_eq!(code, 2);
    assert!(err.contains("--server"), "{err}");
    // The embedded run's devices are fixed: an address it would ignore is refused.
    let (code, out, err) = rcm(&["bench", "--bind", "::1", "-c", "10"]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(out.is_empty(), "the bench ran: {out}");
    assert!(
        err.contains("--bind picks a side's address with --listen"),
        "{err}"
    );
    let (code, _, err) = rcm(&["bench", "--timeout", "18446744073709551615"]);
    assert_eq!(
        code, 2,
        "a huge --timeout is refused, not an overflow panic"
    );
    assert!(err.contains("timeout"), "{err}");
    // A plot that cannot be written stops the run before it starts (it ran the whole bench
    // first, then failed), and a server has no connect latencies to plot.
    let (code, out, err) = rcm(&[
        "bench",
        "--udp-port",
        "26811",
        "--plot",
        "/nonexistent-rcm-dir/lat.svg",
    ]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(out.is_empty(), "the bench ran: {out}");
    assert!(
        err.contains("cannot write the plot to /nonexistent-rcm-dir/lat.svg"),
        "{err}"
    );
    let (code, _, err) = rcm(&["bench", "--listen", "--plot", "lat.svg"]);
    assert_eq!(code, 2);
    assert!(err.contains("--plot"), "{err}");
    // Issuing threads make a burst's calls: none one at a time, none for a server, 1..=64.
    for (args, what) in [
        (vec!["bench", "--serial", "--issuers", "4"], "--serial"),
        (vec!["bench", "--listen", "--issuers", "4"], "--listen"),
        (vec!["bench", "--issuers", "0"], "issuers"),
        (vec!["bench", "--issuers", "65"], "issuers"),
    ] {
        let (code, _, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}");
        assert!(err.contains(what), "{args:?}: {err}");
    }
    // Counts a run cannot carry, refused before it starts.
    for (args, what) in [
        (vec!["ping", "-c", "100000000"], "--count"),
        (
            vec!["ping", "--transport", "iwarp", "-C", "2000"],
            "at most 1024",
        ),
        (vec!["ping", "--ps", "udp", "-S", "6"], "at least 7"),
        (
            vec!["ping", "--ps", "udp", "-C", "100", "-S", "7"],
            "at least 8",
        ),
        // Port 0 is no port to serve or reach (a server's would be an ephemeral one it does
        // not print, and its client would connect to port 0).
        (vec!["ping", "--port", "0"], "--port"),
        (vec!["ping", "--listen", "-p", "0"], "--port"),
        (vec!["bench", "-p", "0"], "--port"),
        (vec!["bench", "--udp-port", "0"], "--udp-port"),
        (vec!["ping", "--udp-port", "0"], "--udp-port"),
        (vec!["stress", "--udp-port", "0"], "--udp-port"),
        (vec!["daemon", "--udp-port", "0"], "--udp-port"),
    ] {
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}: {out}\n{err}");
        assert!(err.contains(what), "{args:?}: {err}");
    }
    // Lengths of time: seconds or a unit, a second to a day; anything else names its option.
    for (args, what) in [
        (vec!["bench", "--timeout", "0"], "--timeout"),
        (vec!["bench", "--timeout", "25h"], "more than a day"),
        (vec!["stress", "-d", "2d"], "--duration"),
        (vec!["stress", "-d", "0s"], "at least 1 s"),
        (vec!["ping", "--timeout", "1.5m"], "--timeout"),
    ] {
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}: {out}\n{err}");
        assert!(out.is_empty(), "{args:?} ran: {out}");
        assert!(err.contains(what), "{args:?}: {err}");
    }
    // 0 connections means "serve forever" for a server only (a client made one).
    for args in [
        vec!["ping", "-c", "0"],
        vec!["ping", "--connect", "127.0.0.1", "-c", "0"],
    ] {
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}: {out}\n{err}");
        assert!(err.contains("--count 0"), "{args:?}: {err}");
    }
    // iWARP works now (tests/iwarp_tools.rs); what it cannot do is a usage error.
    let (code, _, err) = rcm(&["ping", "--transport", "iwarp", "--ps", "udp"]);
    assert_eq!(code, 2);
    assert!(err.contains("iWARP"), "{err}");
    // Private data longer than a message carries is refused before anything starts (a UD
    // ping with 190 bytes used to fail its connect, then wait out --timeout).
    let long = |n: usize| "x".repeat(n);
    for (args, what) in [
        (vec!["--private-data", &*long(57)], "REQ"),
        (
            vec!["--ps", "udp", "--private-data", &*long(137)],
            "SIDR_REP",
        ),
        (vec!["--reject", "--reject-data", &*long(149)], "REJ"),
        (
            vec!["--ps", "udp", "--reject-data", &*long(137)],
            "SIDR_REP",
        ),
    ] {
        let t0 = std::time::Instant::now();
        let mut all = vec!["ping"];
        all.extend(args.iter().copied());
        let (code, _, err) = rcm(&all);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(what), "{args:?}: {err}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{args:?}");
    }
}

/// A run first makes its warm-up connections (cmtime's), one at a time and not counted:
/// 100 by default, never more than -c, as many as asked with --warmup, none with 0; and a
/// server, which makes no connections, refuses the option.
/// An iWARP burst needing more descriptors than the process may open is refused before it
/// runs, saying what would fit: it failed at its end with EMFILE (connects refused,
/// requests rejected) after setting up everything else.
#[test]
fn an_iwarp_burst_beyond_the_open_file_limit_is_refused_up_front() {
    let out = Command::new("bash")
        .arg("-c")
        // `ulimit -n` sets the hard limit too: the tool cannot raise it past 600.
        .arg(format!(
            "ulimit -n 600 && exec {} bench --transport iwarp -c 1000 --udp-port 24995",
            env!("CARGO_BIN_EXE_rcm")
        ))
        .output()
        .expect("bash");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(out.stdout.is_empty(), "the bench ran");
    assert!(err.contains("give -c 172 or fewer"), "{err}");
}

#[test]
fn bench_warms_up_with_uncounted_connections_first() {
    for (args, want) in [
        (&["-c", "30"][..], 30),
        (&["-c", "150"][..], 100),
        (&["-c", "30", "--warmup", "4", "--serial"][..], 4),
        (&["-c", "30", "--warmup", "0"][..], 0),
    ] {
        let mut a = vec!["bench", "--udp-port", "26814", "--json"];
        a.extend_from_slice(args);
        let (code, out, err) = rcm(&a);
        assert_eq!(code, 0, "{a:?}\n{out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["warmup"], want, "{a:?}: {out}");
        // The counted connections are the asked-for ones, all of them up.
        let n = v["connections"].as_u64().unwrap();
        assert_eq!(v["established"], n, "{out}");
        assert_eq!(v["errors"], 0, "{out}");
    }
    let (code, out, _) = rcm(&["bench", "-c", "10", "--udp-port", "26814"]);
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l == "warmup 10"), "{out}");
    let (code, _, err) = rcm(&["bench", "--listen", "--warmup", "3"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--warmup"), "{err}");
}

/// `--qp attached` gives each client id a soft QP that rcm moves itself: every connection
/// comes up, the connect ends with ESTABLISHED (no CONNECT_RESPONSE for the tool to
/// finish), so the init/rtr/rts rows stay empty, where the default (mimicked, as cmtime)
/// fills them; one at a time and over iWARP too. A server has no client QPs to attach.
#[test]
fn bench_with_attached_qps_leaves_the_qp_steps_to_rcm() {
    let row = |v: &serde_json::Value, name: &str| -> f64 {
        v["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .find(|s| s["step"] == name)
            .unwrap_or_else(|| panic!("no {name} row"))["sum_us"]
            .as_f64()
            .expect("sum_us")
    };
    for extra in [
        &["-c", "40"][..],
        &["-c", "20", "--serial"][..],
        &["-c", "20", "--transport", "iwarp", "--port", "7481"][..],
    ] {
        let mut args = vec!["bench", "--qp", "attached", "--udp-port", "26813", "--json"];
        args.extend_from_slice(extra);
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 0, "{args:?}\n{out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let n = v["connections"].as_u64().unwrap();
        assert_eq!(v["established"], n, "{out}");
        assert_eq!(v["errors"], 0, "{out}");
        assert_eq!(v["qp"], "attached");
        let iwarp = extra.contains(&"iwarp");
        assert_eq!(
            v["transport"],
            if iwarp { "iwarp" } else { "roce" },
            "{out}"
        );
        for step in ["init qp attr", "rtr qp attr", "rts qp attr"] {
            assert!(row(&v, step) <= 0.0, "{step} in {args:?}: {out}");
        }
        assert!(row(&v, "cm connect") > 0.0, "{out}");
    }
    let (code, out, err) = rcm(&["bench", "-c", "20", "--udp-port", "26813", "--json"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["qp"], "mimic");
    assert!(row(&v, "rtr qp attr") > 0.0, "{out}");
    let (code, _, err) = rcm(&["bench", "--listen", "--qp", "attached"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--qp"), "{err}");
}

/// The polling round trip says where its two ends ran: on two CPUs where the process may
/// use two, taking turns on one where it may use one (`taskset -c 0`). The report said
/// "on two CPUs" in both cases.
#[test]
fn bench_says_where_the_polling_round_trip_ran() {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let args = ["bench", "--serial", "-c", "20", "--udp-port", "26813"];
    let out = std::process::Command::new("taskset")
        .args(["-c", "0", env!("CARGO_BIN_EXE_rcm")])
        .args(args)
        .output()
        .expect("taskset (util-linux)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("taking turns on the one CPU this process may use"),
        "{text}"
    );
    let mut json = args.to_vec();
    json.push("--json");
    let (code, out, err) = rcm(&json);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    if cpus < 2 {
        assert!(v.get("udp_rtt_poll_cpus").is_none(), "{out}");
        return;
    }
    let two = v["udp_rtt_poll_cpus"]
        .as_array()
        .expect("udp_rtt_poll_cpus");
    assert_eq!(two.len(), 2, "{out}");
    assert_ne!(two[0], two[1], "{out}");
}

/// One at a time, the polling round trip is measured in windows between the connections
/// (before the first, after every tenth, after the last), so that it and the connections
/// see the same stretches of the host's speed; a burst measures it once, after the run.
#[test]
fn bench_serial_measures_the_polling_round_trip_between_its_connections() {
    let (code, out, err) = rcm(&[
        "bench",
        "--serial",
        "-c",
        "30",
        "--udp-port",
        "26831",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["established"], 30, "{out}");
    assert_eq!(v["udp_rtt_poll_windows"], 11, "{out}");
    assert!(v["udp_rtt_poll_p50_us"].as_f64().unwrap() > 0.0, "{out}");
    let (code, out, err) = rcm(&["bench", "--serial", "-c", "30", "--udp-port", "26831"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("in 11 windows between the connections"),
        "{out}"
    );
    let (code, out, err) = rcm(&["bench", "-c", "30", "--udp-port", "26831", "--json"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["udp_rtt_poll_windows"], 0, "{out}");
    assert!(v["udp_rtt_poll_p50_us"].as_f64().unwrap() > 0.0, "{out}");
}

/// The breakdown of a `rcm bench --json` report `out` of `n` connections, each traced
/// (none left out), covering `ends`, with the segments `names` in that order.
fn breakdown_of(out: &str, n: u64, ends: &str, names: &[&str]) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(out).unwrap();
    assert_eq!(v["established"], n, "{out}");
    let b = &v["breakdown"];
    assert_eq!(b["ends"], ends, "{out}");
    assert_eq!(b["connections"], n, "{out}");
    assert_eq!(b["left_out"], 0, "{out}");
    let segs = b["segments"].as_array().expect("segments").clone();
    let got: Vec<&str> = segs
        .iter()
        .map(|s| s["segment"].as_str().unwrap())
        .collect();
    assert_eq!(got, names, "the segments in the connect's order");
    segs
}

/// `--breakdown` splits each one-at-a-time connect at its hops, in both QP modes: every
/// connect's stamps are taken (none is left out on loopback), the segments come in the
/// connect's order, and the text report prints them with the trips and rcm's share. It is
/// refused where this process does not hold both devices, and without `--serial`.
#[test]
fn bench_breakdown_says_where_a_serial_connects_time_goes() {
    let names = rcm_cli::breakdown::SEGMENTS;
    for qp in ["mimic", "attached"] {
        let args = [
            "bench",
            "--serial",
            "--breakdown",
            "-c",
            "40",
            "--qp",
            qp,
            "--udp-port",
            "26851",
            "--json",
        ];
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 0, "{args:?}\n{out}\n{err}");
        let segs = breakdown_of(&out, 40, "both ends", &names);
        for s in &segs {
            assert!(s["p50_us"].as_f64().unwrap() >= 0.0, "{qp}: {s}");
        }
        // Each datagram's trip is a system call and a receive: never nothing.
        for trip in rcm_cli::breakdown::TRIPS {
            assert!(segs[trip]["p50_us"].as_f64().unwrap() > 0.0, "{qp}: {out}");
        }
    }
    let (code, out, err) = rcm(&[
        "bench",
        "--serial",
        "--breakdown",
        "-c",
        "20",
        "--udp-port",
        "26851",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("where a connect's time goes (both ends; medians of 20 connects; µs):"),
        "{out}"
    );
    assert!(
        out.contains("server: CONNECT_REQUEST until accept()"),
        "{out}"
    );
    assert!(out.contains("the two trips"), "{out}");
    // Without it, no stamps and no breakdown.
    let (code, out, err) = rcm(&[
        "bench",
        "--serial",
        "-c",
        "20",
        "--udp-port",
        "26851",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v.get("breakdown").is_none(), "{out}");
    for (args, what) in [
        (vec!["bench", "--breakdown"], "--serial"),
        (
            vec![
                "bench",
                "--serial",
                "--breakdown",
                "--daemon",
                "/tmp/x.sock",
            ],
            "--daemon",
        ),
        (
            vec!["bench", "--serial", "--breakdown", "--listen"],
            "--listen",
        ),
        (
            vec!["bench", "--serial", "--breakdown", "--transport", "iwarp"],
            "RoCEv2",
        ),
    ] {
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}: {out}\n{err}");
        assert!(out.is_empty(), "{args:?} ran: {out}");
        assert!(err.contains(what), "{args:?}: {err}");
    }
}

/// With the server in another process (`--server`), `--breakdown` splits the client's
/// end: its own segments, and the time from its REQ to the REP.
#[test]
fn bench_breakdown_of_the_client_end_against_a_server_elsewhere() {
    let server = start_server(&[
        "bench",
        "--listen",
        "-c",
        "20",
        "--udp-port",
        "26852",
        "--json",
    ]);
    let (code, out, err) = rcm(&[
        "bench",
        "--server",
        "127.0.0.1",
        "--serial",
        "--breakdown",
        "-c",
        "20",
        "--udp-port",
        "26852",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let segs = breakdown_of(&out, 20, "client end", &rcm_cli::breakdown::CLIENT_SEGMENTS);
    // The REQ to the REP holds a round trip and the server's work: never nothing.
    assert!(
        segs[rcm_cli::breakdown::AWAY]["p50_us"].as_f64().unwrap() > 0.0,
        "{out}"
    );
    let s = server.wait_with_output().unwrap();
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
}

/// `--pin` puts the client's thread and the fabric's threads on two CPUs, says which in
/// the report, and is refused where the other side's threads are not this process's.
#[test]
fn bench_pin_places_the_two_sides_on_two_cpus() {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let (code, out, err) = rcm(&[
        "bench",
        "--serial",
        "-c",
        "50",
        "--pin",
        "--udp-port",
        "26812",
        "--json",
    ]);
    if cpus < 2 {
        assert_eq!(code, 2, "{out}\n{err}");
        assert!(err.contains("two CPUs"), "{err}");
        return;
    }
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["established"], 50);
    let pinned: Vec<u64> = v["pinned_cpus"]
        .as_array()
        .expect("pinned_cpus")
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect();
    assert_eq!(pinned.len(), 2);
    assert_ne!(pinned[0], pinned[1]);
    // Without --pin the report does not claim a placement.
    let (code, out, err) = rcm(&["bench", "-c", "20", "--udp-port", "26812", "--json"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v.get("pinned_cpus").is_none(), "{out}");
    for args in [
        vec!["bench", "--pin", "--daemon", "/nonexistent-rcm.sock"],
        vec![
            "bench",
            "--pin",
            "--server",
            "127.0.0.1",
            "--udp-port",
            "26812",
        ],
        vec!["bench", "--pin", "--listen", "--udp-port", "26812"],
    ] {
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}: {out}\n{err}");
        assert!(
            err.contains("--pin applies to the embedded default"),
            "{args:?}: {err}"
        );
    }
}

/// A device's UDP port another socket holds: every command that opens devices says what
/// usually holds it and the ways past it, and exits 2 (it said only "Address already in
/// use" before, and the daemon and stress not even which port). So for an address the
/// host does not have ("Cannot assign requested address" before).
#[test]
fn a_taken_device_port_is_explained() {
    let _holder = std::net::UdpSocket::bind("127.0.0.1:26810").unwrap();
    let sock = std::env::temp_dir().join(format!("rcm-taken-{}.sock", std::process::id()));
    let sock = sock.to_str().unwrap();
    let p = ["--udp-port", "26810"];
    for args in [
        vec!["ping", "--listen", "-c", "1"],
        vec!["bench", "-c", "1"],
        vec!["bench", "--listen", "-c", "1"],
        vec!["stress", "-d", "1"],
        vec!["daemon", "--socket", sock, "--bind", "127.0.0.1"],
    ] {
        let all: Vec<&str> = args.iter().chain(&p).copied().collect();
        let (code, _, err) = rcm(&all);
        assert_eq!(code, 2, "{all:?}: {err}");
        for want in [
            "127.0.0.1",
            "UDP port 26810",
            "is held by another socket",
            "--daemon PATH",
            "another --udp-port",
        ] {
            assert!(err.contains(want), "{all:?}: {want:?} not in {err}");
        }
    }
    assert!(
        !std::path::Path::new(sock).exists(),
        "the daemon left {sock}"
    );
    // An address this host lacks (nothing is sent: the bind fails).
    for args in [
        vec!["ping", "--listen", "--bind", "198.18.0.77"],
        vec![
            "ping",
            "--listen",
            "--bind",
            "198.18.0.77",
            "--transport",
            "iwarp",
        ],
        vec!["bench", "--listen", "--bind", "198.18.0.77"],
        vec!["daemon", "--socket", sock, "--bind", "198.18.0.77"],
        vec![
            "daemon",
            "--socket",
            sock,
            "--bind",
            "198.18.0.77",
            "--transport",
            "iwarp",
        ],
    ] {
        let (code, _, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("198.18.0.77 is not an address of this host"),
            "{args:?}: {err}"
        );
    }
    // The wildcard is no device's address (it listened "on 0.0.0.0" with a device there).
    for args in [
        vec!["ping", "--listen", "--bind", "0.0.0.0"],
        vec!["bench", "--listen", "--bind", "0.0.0.0"],
        vec!["daemon", "--socket", sock, "--bind", "0.0.0.0"],
    ] {
        let (code, _, err) = rcm(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("a device needs a unicast address of this host; 0.0.0.0 is the wildcard"),
            "{args:?}: {err}"
        );
    }
}

/// The contract's command lines as they are written, no `--bind`: `rcm bench --listen -c N`
/// serves N connections and exits 0 with its own JSON report; `rcm bench --server IP`
/// connects from the default source (127.0.0.2 toward 127.0.0.1).
#[test]
fn bench_server_and_client_processes_without_bind() {
    let server = start_server(&[
        "bench",
        "--listen",
        "-c",
        "20",
        "--udp-port",
        "26805",
        "--json",
    ]);
    let (code, out, err) = rcm(&[
        "bench",
        "--server",
        "127.0.0.1",
        "-c",
        "20",
        "--udp-port",
        "26805",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let c: serde_json::Value = serde_json::from_str(&out).expect("client JSON");
    assert_eq!(
        (c["established"].as_u64(), c["errors"].as_u64()),
        (Some(20), Some(0))
    );
    let s = server.wait_with_output().unwrap();
    let sout = String::from_utf8_lossy(&s.stdout);
    assert!(
        s.status.success(),
        "{sout}{}",
        String::from_utf8_lossy(&s.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&sout).expect("server JSON");
    assert_eq!(v["role"], "server", "{sout}");
    assert_eq!(v["established"], 20, "{sout}");
    assert_eq!(v["open_at_end"], 0, "{sout}");
}

#[test]
fn ping_both_roles_in_one_process() {
    let (code, out, err) = rcm(&[
        "ping",
        "-c",
        "3",
        "--udp-port",
        "26794",
        "--private-data",
        "abc123",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(
            "3 of 3 established, 3 disconnected, 0 rejected, private data matched 6 time(s)"
        ),
        "{out}"
    );
}

/// With both ends in one process, `--bind` puts both on that one device: over IPv6 (`::1`
/// has no second loopback address) for RoCEv2 connections, UD and iWARP. It was ignored,
/// and the run went over 127.0.0.1 and 127.0.0.2 whatever was asked.
#[test]
fn ping_both_roles_on_one_device_given_by_bind() {
    let (code, out, err) = rcm(&["ping", "--bind", "::1", "-c", "2", "--udp-port", "26797"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("established to [::1]:7471"), "{out}");
    assert!(!out.contains("127.0.0."), "{out}");
    assert!(out.contains("2 of 2 established, 2 disconnected"), "{out}");
    for extra in [
        &["--ps", "udp"][..],
        &["--transport", "iwarp", "-p", "26798"][..],
    ] {
        let mut args = vec!["ping", "--bind", "::1", "-c", "1", "--udp-port", "26797"];
        args.extend_from_slice(extra);
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 0, "{extra:?}: {out}\n{err}");
        assert!(out.contains("[::1]"), "{extra:?}: {out}");
        assert!(out.contains("1 of 1 established, 1 disconnected"), "{out}");
    }
}

#[test]
fn ping_ud_and_reject_and_json() {
    let (code, out, err) = rcm(&[
        "ping",
        "--ps",
        "udp",
        "-c",
        "2",
        "--udp-port",
        "26795",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["established"], 2);
    let (code, out, _) = rcm(&["ping", "--reject", "-c", "2", "--udp-port", "26796"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("2 rejected"), "{out}");
}

/// `--reject` counts only the server's own reject (reason 28, consumer defined): a REJ for
/// a port nobody listens on (reason 8) is an error, even when the expected private data is
/// empty and so matches anything.
#[test]
fn ping_reject_is_not_satisfied_by_a_missing_listener() {
    let server = start_server(&[
        "ping",
        "--listen",
        "--bind",
        "127.0.0.1",
        "-p",
        "7998",
        "--udp-port",
        "26806",
        "--timeout",
        "5s",
    ]);
    let (code, out, err) = rcm(&[
        "ping",
        "--reject",
        "--private-data",
        "",
        "--connect",
        "127.0.0.1",
        "-p",
        "7999",
        "--udp-port",
        "26806",
        "--timeout",
        "5",
    ]);
    // Our own child, by its PID: it would otherwise wait out its --timeout.
    let mut server = server;
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        format!("{out}{err}").contains("not by the server's reject"),
        "{out}\n{err}"
    );
}

#[test]
fn ping_separate_server_and_client_processes() {
    let server = start_server(&[
        "ping",
        "--listen",
        "--bind",
        "127.0.0.1",
        "-c",
        "2",
        "--udp-port",
        "26797",
        "--timeout",
        "20",
    ]);
    let (code, out, err) = rcm(&[
        "ping",
        "--connect",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
        "-c",
        "2",
        "--udp-port",
        "26797",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let s = server.wait_with_output().unwrap();
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stdout));
}

/// A connection that fails in one step is neither called again in the next steps (those
/// calls could only fail for its state: the report listed them as more failures) nor waited
/// for until the step's timeout. Here both fail address resolution at once: `resolve_addr`
/// to ::1 from an id bound to an IPv4 address fails the call (Linux: -EINVAL).
#[test]
fn bench_failed_connections_are_reported_once_and_not_waited_for() {
    let t0 = std::time::Instant::now();
    let (v, out) = failed_bench_json(&["--server", "::1", "--udp-port", "26804"]);
    assert_eq!(v["established"], 0, "{out}");
    assert_eq!(v["errors"], 2, "{out}");
    let failures = v["failures"].as_array().cloned().unwrap_or_default();
    assert_eq!(failures.len(), 2, "one failure per connection: {out}");
    assert!(
        failures.iter().all(|f| f
            .as_str()
            .is_some_and(|f| f.contains("resolve addr: invalid argument"))),
        "{out}"
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(20),
        "it waited for a timeout"
    );
    // The TCP baseline is this host's loopback: refused beside a run to another host.
    let (code, _, err) = rcm(&[
        "bench",
        "--server",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
        "--baseline",
        "tcp",
        "--udp-port",
        "26804",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--baseline tcp runs on loopback only"),
        "{err}"
    );
}

/// `rcm bench --bind 127.0.0.2 -c 2 --json` with `args`, which must fail: its report and
/// its output.
fn failed_bench_json(args: &[&str]) -> (serde_json::Value, String) {
    let (code, out, err) = rcm(&[
        &["bench", "--bind", "127.0.0.2", "-c", "2", "--json"][..],
        args,
    ]
    .concat());
    assert_ne!(code, 0, "{out}\n{err}");
    let v = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    (v, out)
}

/// With no server at the other end, the step that waits for the peer ends at `--timeout`,
/// and the failure says which step it was and what to check (it said only "timed out with
/// N connection(s) still waiting").
#[test]
fn bench_without_a_server_says_which_step_timed_out() {
    let (v, out) = failed_bench_json(&[
        "--server",
        "127.0.0.1",
        "--timeout",
        "1",
        "--udp-port",
        "26809",
    ]);
    assert_eq!(v["errors"], 2, "{out}");
    assert_eq!(
        v["failures"],
        serde_json::json!([
            "cm connect: timed out after 1 s with 2 connection(s) still waiting (no answer \
             from the peer: is the server running and reachable? --timeout waits longer)"
        ]),
        "{out}"
    );
}

/// A server in its own process, started once it says it listens.
fn ping_server(args: &[&str]) -> std::process::Child {
    let mut server = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = server.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(out));
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains("listening on"))),
        "the server never listened"
    );
    // The rest of its output is not needed; keep the pipe drained.
    std::thread::spawn(move || lines.for_each(drop));
    server
}

/// A server that serves forever (`-c 0`) never reaches its report: each error is printed
/// on standard error as it comes (here a request whose private data differs). It kept
/// them to print at its end, which only a signal brought, and they were never seen.
#[test]
fn a_ping_server_serving_forever_prints_each_error_as_it_comes() {
    use std::io::BufRead;
    let mut server = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args([
            "ping",
            "--listen",
            "--bind",
            "127.0.0.1",
            "-c",
            "0",
            "--udp-port",
            "26816",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = server.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(out).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains("listening on"))),
        "the server never listened"
    );
    std::thread::spawn(move || lines.for_each(drop));
    let (tx, rx) = std::sync::mpsc::channel();
    let err = server.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let (code, cout, cerr) = rcm(&[
        "ping",
        "--connect",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
        "--udp-port",
        "26816",
        "--private-data",
        "other",
    ]);
    assert_ne!(code, 0, "{cout}\n{cerr}");
    let said = rx.recv_timeout(std::time::Duration::from_secs(10));
    server.kill().expect("kill our server");
    let _ = server.wait();
    let said = said.expect("the server printed nothing on standard error");
    assert!(
        said.contains("error: server: request private data differs"),
        "{said}"
    );
}

/// `--reject` on the client is a claim the client checks: a reject whose private data is not
/// `--reject-data`, or no reject at all (the server accepted), fails the run with the reason.
#[test]
fn ping_client_fails_when_the_reject_is_not_what_it_expects() {
    // (server's options, client's options, what the client must say)
    let cases: [(&[&str], &[&str], &str); 2] = [
        (
            &["--reject", "--reject-data", "no"],
            &["--reject", "--reject-data", "nope"],
            "client 0: reject private data differs",
        ),
        (&[], &["--reject"], "--reject expects the server to reject"),
    ];
    for (k, (server_opts, client_opts, says)) in cases.into_iter().enumerate() {
        let port = (26802 + k).to_string();
        let common = ["-c", "1", "--udp-port", port.as_str()];
        let mut server = ping_server(
            &[
                &["ping", "--listen", "--bind", "127.0.0.1", "--timeout", "20"][..],
                &common,
                server_opts,
            ]
            .concat(),
        );
        let (code, out, err) = rcm(&[
            &["ping", "--connect", "127.0.0.1", "--bind", "127.0.0.2"][..],
            &common,
            client_opts,
        ]
        .concat());
        assert_ne!(code, 0, "{out}\n{err}");
        assert!(format!("{out}{err}").contains(says), "{out}\n{err}");
        let _ = server.wait();
    }
}

#[test]
fn bench_client_on_several_addresses_against_a_separate_server() {
    let mut server = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args([
            "bench",
            "--listen",
            "--bind",
            "127.0.0.1",
            "--udp-port",
            "26801",
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (code, out, err) = rcm(&[
        "bench",
        "--server",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
        "--bind",
        "127.0.0.3",
        "-c",
        "40",
        "--udp-port",
        "26801",
        "--json",
    ]);
    server.kill().unwrap();
    let _ = server.wait();
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["established"], 40, "{out}");
    assert_eq!(v["errors"], 0, "{out}");
    // This process holds only the client ends, and says so.
    assert_eq!(v["rss_scope"], "client ends", "{out}");
    // A server serves on one address.
    let (code, _, err) = rcm(&[
        "bench",
        "--listen",
        "--bind",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("one --bind"), "{err}");
}

#[test]
fn ping_against_nobody_fails_with_the_reason() {
    let (code, out, _) = rcm(&[
        "ping",
        "--connect",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
        "--udp-port",
        "26798",
        "--timeout",
        "3",
        "--count",
        "2",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("timed out with 2 connection(s) unfinished"),
        "{out}"
    );
    // Each connection says what it waited for: here the REQ went unanswered (no CM there).
    for i in 0..2 {
        let line = format!("client {i}: no answer from 127.0.0.1:7471 to the connect request");
        assert!(out.contains(&line), "{out}");
    }
}

#[test]
fn help_texts_name_every_option() {
    for (cmd, opts) in [
        (
            "bench",
            &[
                "--connections",
                "--serial",
                "--transport",
                "--baseline",
                "--json",
                "--plot",
                "--listen",
                "--server",
            ][..],
        ),
        (
            "ping",
            &[
                "--listen",
                "--connect",
                "--bind",
                "--port",
                "--count",
                "--ps",
                "--reject",
                "--private-data",
                "--json",
            ][..],
        ),
    ] {
        let (code, out, _) = rcm(&[cmd, "--help"]);
        assert_eq!(code, 0);
        for o in opts {
            assert!(out.contains(o), "{cmd} --help lacks {o}");
        }
    }
}

#[test]
fn ping_reject_data_is_sent_and_checked() {
    // Both roles in one process: the server rejects with its own private data, the client
    // checks it byte for byte.
    let (code, out, err) = rcm(&[
        "ping",
        "--reject",
        "--reject-data",
        "rcm says no",
        "-c",
        "2",
        "--udp-port",
        "26793",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["rejected"], 2);
    // Server: 2 requests with the connect data; client: 2 rejects with the reject data.
    assert_eq!(v["private_data_ok"], 4);
    assert_eq!(v["errors"].as_array().map(Vec::len), Some(0));
}

/// `rcm stress --callbacks threads|batched|inline`: every mode runs the same races (channel-mode
/// clients among them) with no violation and drops every context it made; an unknown mode
/// is a usage error.
#[test]
fn stress_in_every_callback_mode() {
    for (mode, port) in [
        ("threads", "26781"),
        ("batched", "26782"),
        ("inline", "26783"),
    ] {
        let (code, out, err) = rcm(&[
            "stress",
            "-d",
            "2s",
            "--seed",
            "11",
            "--callbacks",
            mode,
            "--udp-port",
            port,
            "--json",
        ]);
        assert_eq!(code, 0, "{mode}: {out}\n{err}");
        let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        assert_eq!(r["transport"], "roce", "{mode}: {out}");
        // What repeats the run (the text output prints them on its first line).
        assert_eq!(
            (&r["seed"], &r["threads"], &r["duration_s"]),
            (
                &serde_json::json!(11),
                &serde_json::json!(4),
                &serde_json::json!(2)
            ),
            "{mode}: {out}"
        );
        assert_eq!(
            r["violations"].as_array().map(Vec::len),
            Some(0),
            "{mode}: {out}"
        );
        assert!(r["established"].as_u64().unwrap_or(0) > 0, "{mode}: {out}");
        assert!(r["removals"].as_u64().unwrap_or(0) > 0, "{mode}: {out}");
        // Destroys from inside callbacks happen (and each answered Deferred, or it would be
        // a violation above).
        assert!(r["deferred"].as_u64().unwrap_or(0) > 0, "{mode}: {out}");
        assert_eq!(r["contexts"][0], r["contexts"][1], "{mode}: {out}");
        // Channel-mode clients ran beside the callback ones, their events taken by the
        // consumers (a late one would be a violation above).
        assert!(r["channel_ids"].as_u64().unwrap_or(0) > 0, "{mode}: {out}");
        assert!(
            r["channel_events"].as_u64().unwrap_or(0) > 0,
            "{mode}: {out}"
        );
    }
    let (code, _, err) = rcm(&["stress", "--callbacks", "sometimes"]);
    assert_eq!(code, 2);
    assert!(err.contains("--callbacks"), "{err}");
}

/// `rcm stress --transport iwarp`: the same races over iWARP devices (a TCP stream per
/// connection; callbacks inline, so the device threads run them, and channel-mode clients
/// whose consumers poll the iWARP devices), with device removal, no violation, and every
/// context dropped; `--transport` with `--daemon` is a usage error (the daemon's devices
/// are what it was started with).
#[test]
fn stress_on_iwarp_devices() {
    let (code, out, err) = rcm(&[
        "stress",
        "-d",
        "2s",
        "--seed",
        "12",
        "--transport",
        "iwarp",
        "--callbacks",
        "inline",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(r["transport"], "iwarp", "{out}");
    assert_eq!(r["violations"].as_array().map(Vec::len), Some(0), "{out}");
    for what in [
        "established",
        "rejected",
        "removals",
        "deferred",
        "channel_events",
    ] {
        assert!(r[what].as_u64().unwrap_or(0) > 0, "{what}: {out}");
    }
    assert_eq!(r["contexts"][0], r["contexts"][1], "{out}");
    let (code, _, err) = rcm(&[
        "stress",
        "--transport",
        "iwarp",
        "--daemon",
        "/nonexistent/rcm.sock",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("--daemon"), "{err}");
}

/// A raw RoCEv2 CM client on 127.0.0.2 facing a `--listen` server on 127.0.0.1 (UDP port
/// `udp`): it sends what a test scripts, and reads the server's REP.
struct RawClient {
    sock: std::net::UdpSocket,
    udp: u16,
}

impl RawClient {
    const ME: std::net::Ipv4Addr = std::net::Ipv4Addr::new(127, 0, 0, 2);

    fn new(udp: u16) -> Self {
        let sock = std::net::UdpSocket::bind((Self::ME, udp)).expect("bind 127.0.0.2");
        sock.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .expect("timeout");
        RawClient { sock, udp }
    }

    fn send(&self, mad: [u8; 256]) {
        use rcm_wire::roce::{emit_gsi, IpForIcrc};
        let srv = std::net::Ipv4Addr::LOCALHOST;
        let d = emit_gsi(&IpForIcrc::v4(Self::ME, srv), self.udp, 0, &mad);
        self.sock.send_to(&d, (srv, self.udp)).expect("send");
    }

    /// A REQ from comm ID `id` and QPN `qpn` to port 7471; the REP it gets back.
    fn request(&self, id: u32, qpn: u32) -> rcm_wire::cm::Rep {
        use rcm_wire::cm::{CmMad, CmMessage};
        use rcm_wire::roce::GsiDatagram;
        let srv = std::net::Ipv4Addr::LOCALHOST;
        self.send(common::req_mad(Self::ME, srv, 7471, id, 1, qpn));
        loop {
            let mut buf = [0u8; 4096];
            let (n, _) = self.sock.recv_from(&mut buf).expect("the REP within 10 s");
            let d = GsiDatagram::parse(&buf[..n]).expect("GSI");
            if let CmMessage::Rep(rep) = CmMad::parse(d.mad).expect("CM MAD").msg {
                return rep;
            }
        }
    }
}

/// `rcm bench --listen -c 1 --json` on UDP port `udp`, started.
fn listen_for_one(udp: u16) -> std::process::Child {
    start_server(&[
        "bench",
        "--listen",
        "-c",
        "1",
        "--udp-port",
        &udp.to_string(),
        "--json",
    ])
}

/// A `--listen` server's JSON report: (accepted, established, open at its end).
fn served(sout: &str) -> (u64, u64, u64) {
    let v: serde_json::Value = serde_json::from_str(sout).expect("server JSON");
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {sout}"));
    (n("accepted"), n("established"), n("open_at_end"))
}

/// Waits up to 30 s for a server (ours) to exit by itself, killing it if it does not; its
/// output.
fn server_output(mut server: std::process::Child) -> std::process::Output {
    let t0 = std::time::Instant::now();
    while server.try_wait().expect("try_wait").is_none() {
        if t0.elapsed() > std::time::Duration::from_secs(30) {
            let _ = server.kill();
            let out = server.wait_with_output().expect("output");
            panic!(
                "the server still waits: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    server.wait_with_output().expect("output")
}

/// A connection the server accepted and that went down before its RTU came (lost, and the
/// client disconnected before a REP retry): DISCONNECTED without ESTABLISHED on the server,
/// as in Linux. `--listen -c` counts it served; it waited for good when it counted only
/// ESTABLISHED (seen in a 100,000-connection run, 97,280 of 100,000 "served").
#[test]
fn bench_listen_counts_a_connection_that_never_saw_its_rtu() {
    let udp = 26807u16;
    let server = listen_for_one(udp);
    // REQ, REP back, then DREQ with no RTU.
    let c = RawClient::new(udp);
    let rep = c.request(0x5151, 0x99);
    c.send(common::dreq_mad(0x5151, rep.local_comm_id, rep.local_qpn));
    // It exits by itself once its one connection is down.
    let out = server_output(server);
    let sout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{sout}");
    assert_eq!(served(&sout), (1, 0, 0), "{sout}");
}

/// A `--listen -c` server whose client established its connection and never disconnected:
/// after its 10 s wait it reports the connection still open and exits 1 ("0 when every
/// connection was established and disconnected"). It exited 0.
#[test]
fn bench_listen_fails_when_a_connection_is_still_open_at_its_end() {
    use rcm_wire::cm::{CmMad, CmMessage, Rtu};
    let udp = 26815u16;
    let server = listen_for_one(udp);
    // REQ, REP back, RTU; then nothing.
    let c = RawClient::new(udp);
    let rep = c.request(0x5252, 0x98);
    let rtu = Rtu {
        local_comm_id: 0x5252,
        remote_comm_id: rep.local_comm_id,
        ..Rtu::default()
    };
    c.send(
        CmMad::send(0x5252, CmMessage::Rtu(rtu))
            .emit()
            .expect("RTU encodes"),
    );
    let out = server_output(server);
    let (sout, serr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{sout}\n{serr}");
    assert_eq!(served(&sout), (1, 1, 1), "{sout}");
    assert!(serr.contains("still open"), "{serr}");
}

/// A server that accepts and then never disconnects: after its grace the client ends the
/// connection itself and says so (as when, under loss, a server gave up a connection whose
/// RTUs were all lost: not an error, but not silent either).
#[test]
fn ping_client_says_when_it_disconnected_what_the_server_left_open() {
    use rcm::{AcceptOptions, Event, Fabric, FabricConfig, Flow, PortSpace};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let udp = 26808u16;
    let fabric = Fabric::new(FabricConfig {
        udp_port: udp,
        ..FabricConfig::default()
    });
    fabric
        .add_device(IpAddr::V4(Ipv4Addr::LOCALHOST))
        .expect("device 127.0.0.1");
    let l = fabric
        .try_create_id(PortSpace::Tcp, |id, ev| {
            // As rcm ping's server: its private data back (the REQ's 56 bytes, padded).
            if let Event::ConnectRequest { private_data, .. } = ev {
                let _ = id.accept(&AcceptOptions {
                    private_data: private_data.clone(),
                    ..AcceptOptions::default()
                });
            }
            Flow::Continue
        })
        .expect("listener");
    l.bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 7471))
        .expect("bind");
    l.listen(4).expect("listen");
    let (code, out, err) = rcm(&[
        "ping",
        "--connect",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
        "-c",
        "1",
        "--udp-port",
        &udp.to_string(),
        "--timeout",
        "30",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("1 of 1 established"), "{out}\n{err}");
    assert!(
        out.contains("1 established connection(s) the server left open for 10 s"),
        "{out}\n{err}"
    );
    fabric.shutdown();
}

/// A serial run beside a CPU-bound process on the calling thread's CPU: the thread's yields
/// are stolen, rcm holds it off polling (it sleeps instead), and the report says so, in the
/// JSON and as a printed warning, since the latencies then include those sleeps.
#[test]
fn bench_reports_polling_held_off_by_a_cpu_bound_neighbour() {
    let cpus = common::allowed_cpus();
    if cpus.len() < 2 {
        eprintln!(
            "skipped: `--pin` needs two CPUs, this test has {}",
            cpus.len()
        );
        return;
    }
    // `--pin` puts the calling thread on the first CPU it may use.
    let hog = common::Hog::on_cpu(cpus[0]);
    let args = [
        "bench",
        "-c",
        "200",
        "--serial",
        "--pin",
        "--udp-port",
        "26925",
    ];
    let (code, out, err) = rcm(&[&args[..], &["--json"]].concat());
    let (code2, text, err2) = rcm(&args);
    drop(hog);
    assert_eq!(code, 0, "{out}\n{err}");
    let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(r["established"], 200, "{out}");
    assert!(r["hold_offs"].as_u64().unwrap_or(0) > 0, "{out}");
    assert_eq!(code2, 0, "{text}\n{err2}");
    assert!(text.contains("contention: "), "{text}");
}

/// The TCP listeners of process `pid` that /proc shows: their local addresses.
fn tcp_listeners_of(pid: u32) -> Vec<std::net::SocketAddr> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    proc_tcp_sockets(&format!("/proc/{pid}/net"), true)
        .into_iter()
        .filter(|s| s.state == "0A" && inodes.contains(&s.inode))
        .map(|s| s.local)
        .collect()
}

/// One line of /proc/net/tcp or tcp6.
struct ProcTcp {
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
    state: String,
    inode: String,
}

/// The TCP sockets of the network namespace that `net` (a /proc/.../net directory) shows;
/// with `listening_only`, only the listening ones, which the kernel lists first (its walk
/// takes the listening hash before the established one): the read stops at the first other
/// socket. Reading all of a host with tens of thousands of sockets in TIME_WAIT took 160 ms,
/// longer than a baseline's listener lived.
fn proc_tcp_sockets(net: &str, listening_only: bool) -> Vec<ProcTcp> {
    // The kernel prints each address as the native-endian words of its network-order bytes.
    fn addr(s: &str) -> Option<std::net::SocketAddr> {
        let (ip, port) = s.split_once(':')?;
        let port = u16::from_str_radix(port, 16).ok()?;
        let words: Option<Vec<[u8; 4]>> = (0..ip.len() / 8)
            .map(|k| {
                let w = u32::from_str_radix(ip.get(8 * k..8 * k + 8)?, 16).ok()?;
                Some(w.to_ne_bytes())
            })
            .collect();
        let bytes: Vec<u8> = words?.concat();
        let ip = match bytes.len() {
            4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
            16 => std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
            _ => return None,
        };
        Some(std::net::SocketAddr::new(ip, port))
    }
    use std::io::BufRead;
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|f| std::fs::File::open(format!("{net}/{f}")).ok())
        .flat_map(|file| {
            std::io::BufReader::new(file)
                .lines()
                .skip(1)
                .map_while(Result::ok)
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    Some(ProcTcp {
                        local: addr(f.get(1)?)?,
                        remote: addr(f.get(2)?)?,
                        state: f.get(3)?.to_string(),
                        inode: f.get(9)?.to_string(),
                    })
                })
                .take_while(|s| !listening_only || s.state == "0A")
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `--baseline tcp` listens on loopback only (it listened on 0.0.0.0: open on every
/// interface while it ran), and its connections come from many 127.0.x.y, so that TIME_WAIT,
/// which holds a 4-tuple for a minute, does not cap it.
#[test]
fn bench_tcp_baseline_listens_on_loopback_only() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args([
            "bench",
            "-c",
            "10000",
            "--baseline",
            "tcp",
            "--udp-port",
            "41100",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn rcm");
    let pid = child.id();
    let mut listeners = std::collections::BTreeSet::new();
    // The report is a few lines: the pipes cannot fill while the process runs.
    while child.try_wait().expect("try_wait").is_none() {
        listeners.extend(tcp_listeners_of(pid));
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let out = child.wait_with_output().expect("output");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}\n{err}");
    assert!(text.contains("TCP baseline "), "{text}");
    assert!(
        !listeners.is_empty(),
        "the baseline's listener was never seen"
    );
    assert!(
        listeners.iter().all(|a| a.ip().is_loopback()),
        "listening beyond loopback: {listeners:?}"
    );
    // The connections' 4-tuples, left in TIME_WAIT at one end or the other, differ in
    // their client address.
    let sources: std::collections::HashSet<std::net::IpAddr> = proc_tcp_sockets("/proc/net", false)
        .into_iter()
        .filter(|s| s.state == "06")
        .filter_map(|s| {
            if listeners.contains(&s.remote) {
                Some(s.local.ip())
            } else if listeners.contains(&s.local) {
                Some(s.remote.ip())
            } else {
                None
            }
        })
        .collect();
    assert!(
        sources.len() > 100 && sources.iter().all(std::net::IpAddr::is_loopback),
        "{} client addresses: {sources:?}",
        sources.len()
    );
}

/// With no connection established there is no latency to report: the JSON has null there
/// (0.0 read as measured), the text says n/a.
#[test]
fn bench_with_nothing_established_reports_no_latency() {
    let (v, out) = failed_bench_json(&["--server", "::1", "--udp-port", "41101"]);
    assert_eq!(v["established"], 0, "{out}");
    for k in ["connect_p50_us", "connect_p99_us"] {
        assert!(
            v.get(k).is_some_and(serde_json::Value::is_null),
            "{k}: {out}"
        );
    }
    let (code, text, err) = rcm(&[
        "bench",
        "--bind",
        "127.0.0.2",
        "-c",
        "2",
        "--server",
        "::1",
        "--udp-port",
        "41101",
    ]);
    assert_ne!(code, 0, "{text}\n{err}");
    assert!(
        text.contains("connect latency p50 n/a  p99 n/a"),
        "{text}\n{err}"
    );
}

/// The points of the plot's CDF polyline.
fn plot_points(svg: &str) -> Vec<(f64, f64)> {
    let pts = svg
        .split("points=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("no polyline: {svg}"));
    pts.split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap_or_else(|| panic!("point {p}"));
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

/// The plot shows a run of one connection (a one-point polyline drew nothing), and its CDF
/// reaches 1.0 at the slowest connection when the samples are thinned (a count that is no
/// multiple of the step left the last one out).
#[test]
fn bench_plot_shows_one_connection_and_ends_at_the_slowest() {
    let dir = std::env::temp_dir().join(format!("rcm-bench-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for c in ["1", "1000"] {
        let plot = dir.join(format!("lat-{c}.svg"));
        let (code, out, err) = rcm(&[
            "bench",
            "-c",
            c,
            "--udp-port",
            "41102",
            "--plot",
            plot.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{out}\n{err}");
        let svg = std::fs::read_to_string(&plot).unwrap();
        let pts = plot_points(&svg);
        let (first, last) = (pts[0], pts[pts.len() - 1]);
        assert!(
            pts.len() >= 2 && first != last,
            "-c {c}: nothing drawn: {pts:?}"
        );
        // The plot area is 50..590 across and 350 (0) up to 50 (1.0).
        assert_eq!(last, (590.0, 50.0), "-c {c}: {pts:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The rcm/TCP ratio says what it compares in a burst too (the headline figure), not only
/// one at a time.
#[test]
fn bench_tcp_ratio_says_what_it_compares_in_both_modes() {
    for serial in [false, true] {
        let mut args = vec![
            "bench",
            "-c",
            "50",
            "--baseline",
            "tcp",
            "--udp-port",
            "41103",
        ];
        if serial {
            args.push("--serial");
        }
        let (code, out, err) = rcm(&args);
        assert_eq!(code, 0, "{out}\n{err}");
        let line = out
            .lines()
            .find(|l| l.contains("rcm/TCP"))
            .unwrap_or_else(|| panic!("no ratio: {out}"));
        assert!(
            line.contains("the baseline two at a time"),
            "serial {serial}: {line}"
        );
    }
}
