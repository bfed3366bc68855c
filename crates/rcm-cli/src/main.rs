//! The `rcm` command: the benchmark, ping, stress, the access daemon, and capture decoding.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "rcm",
    version,
    about = "rcm: an RDMA connection manager in user space"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Connection-setup benchmark (cmtime for rcm). With no options it runs a server and a
    /// client in this process on two loopback devices (127.0.0.1, 127.0.0.2; the client
    /// takes 127.0.0.3 on too, one device per 25,000 connections), connects all
    /// connections at once, and prints cmtime's per-step table, the connect rate, connect
    /// latency percentiles and the loopback UDP round trip measured in the same run.
    ///
    /// Exit status: 0 when every connection was established and disconnected, 1 otherwise,
    /// 2 on bad usage or when the devices cannot be opened.
    Bench(BenchArgs),
    /// Make connections and check private data byte for byte both ways (ucmatose/udaddy for
    /// rcm). `--listen` serves, `--connect IP` connects; with neither, both run here on
    /// loopback. The server disconnects each connection once established; a client whose
    /// server has not done so within 10 s disconnects it itself and says so (apart from the
    /// errors: under loss a server may have given up a connection its client holds).
    ///
    /// Exit status: 0 exactly when every connection was established and disconnected cleanly
    /// (with --reject: rejected as asked); 1 otherwise, with the event and reason printed; 2 on
    /// bad usage. A server reports an accepted connection its client never confirmed (REP
    /// timeout: the peer went away, or under loss all its RTUs were lost, which IBTA allows)
    /// as "unconfirmed", apart from the errors; the run still exits 1.
    Ping(PingArgs),
    /// Race create, connect, accept, reject, disconnect, destroy, non-blocking destroy and
    /// device removal from several threads against one in-process fabric, checking the
    /// lifecycle invariants; prints what it checked and the counts. Some clients are
    /// channel-mode ids whose events consumer threads take from a shared event channel
    /// while the workers destroy them.
    ///
    /// Exit status: 0 when every invariant held, 1 otherwise (each violation printed).
    Stress(StressArgs),
    /// The access daemon: owns the RoCEv2 devices of the --bind addresses (one process per
    /// host address owns UDP 4791, as the kernel owns QP1) and serves rcm clients over a Unix
    /// socket (`--daemon PATH` of bench/ping/stress, or `rcm_ucm::fabric` in a program).
    /// Each client sees only its own ids; everything a client held is destroyed when it exits.
    /// Logs to stderr (RUST_LOG=debug for more). SIGTERM or SIGINT: destroys every id
    /// gracefully (peers see DREQ or REJ), removes the socket, exits 0.
    ///
    /// On a host with few CPUs, give the daemon a CPU its clients do not use (`taskset -c 1
    /// rcm daemon ...`, clients under `taskset -c 0`): its thread then never waits behind a
    /// client's polling thread (on a 2-vCPU VM, bench bursts through it 23-25k -> 30-33k
    /// conn/s).
    ///
    /// Exit status: 0 after a clean shutdown; 2 when it cannot start (bad usage, a live daemon
    /// on the socket, a device that cannot be opened).
    Daemon(DaemonArgs),
    /// Decode RDMA CM traffic in a pcap/pcapng file: IB CM MADs over RoCEv2 (UDP 4791) and
    /// iWARP MPA over TCP, one line per message, every ICRC and MPA CRC verified.
    ///
    /// TCP connections that do not start with an MPA key are not iWARP: they are listed
    /// (SYN, FIN) and their data skipped, not reported as corrupt.
    ///
    /// Exit status: 0 when every RoCEv2/MPA packet decoded and verified, 1 when any was
    /// corrupt (reported with error=...) or the file ends inside a record (what came before
    /// is decoded; a warning says where), 2 when the file could not be read.
    Decode {
        /// The capture file (pcap or pcapng; Ethernet, Linux cooked, raw IP or loopback).
        file: PathBuf,
        /// Print every field of every message under its line.
        #[arg(short, long)]
        verbose: bool,
        /// One JSON object per line (all fields included) instead of text.
        #[arg(long, conflicts_with = "verbose")]
        json: bool,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Connections (default 1000). With --listen: accept this many, then exit once they are
    /// down (waiting at most 10 s; without -c, serve until interrupted).
    #[arg(short = 'c', long = "connections",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    connections: Option<u32>,
    /// Make connections one at a time (latency) instead of all in flight (throughput).
    #[arg(long)]
    serial: bool,
    /// Transport: roce (RoCEv2 CM over UDP) or iwarp (MPA over TCP).
    #[arg(long, default_value = "roce", value_parser = ["roce", "iwarp"])]
    transport: String,
    /// Callback threads (used with --no-send-batch; by default the server's callbacks run on
    /// the device threads and the client takes its events from a channel).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
    /// rdma_cm port (TCP port space).
    #[arg(short = 'p', long, default_value_t = 7471, value_parser = clap::value_parser!(u16).range(1..))]
    port: u16,
    /// UDP port of the RoCEv2 devices (4791 is the standard; change it to run beside another rcm).
    #[arg(long, default_value_t = 4791, value_parser = clap::value_parser!(u16).range(1..))]
    udp_port: u16,
    /// Also time the TCP baseline: the same N connections as TCP connect + 56-byte exchange + close, over loopback (with the embedded default or --daemon; refused with --server/--listen).
    #[arg(long, value_parser = ["tcp"])]
    baseline: Option<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Write the connect-latency distribution (CDF) as an SVG file (the client's; created
    /// before the run, so a path that cannot be written stops it at once).
    #[arg(long, value_name = "FILE.svg", conflicts_with = "listen")]
    plot: Option<PathBuf>,
    /// Serve only, on --bind (default 127.0.0.1; another host runs the client with --server).
    #[arg(long, conflicts_with = "server")]
    listen: bool,
    /// Run only the client, against a server on this address.
    #[arg(long, value_name = "IP")]
    server: Option<std::net::IpAddr>,
    /// Local address of this side (its device). The client (--server) takes it more than
    /// once to spread its ids over several devices: one address has ~28,000 ephemeral
    /// ports, so 100,000 connections need four. Default with --listen 127.0.0.1; with
    /// --server, 127.0.0.2 toward a loopback server (127.0.0.1 toward 127.0.0.2, ::1 toward
    /// ::1), else the address the routing table picks for the server. Refused without
    /// --listen, --server or --daemon: the embedded run's devices are 127.0.0.1 and
    /// 127.0.0.2 (and 127.0.0.3 on, one per 25,000 connections, for the client).
    #[arg(long, value_name = "IP")]
    bind: Vec<std::net::IpAddr>,
    /// How long to wait for any one step before giving up: seconds, or a number with a unit
    /// (90s, 5m, 1h; at most a day).
    #[arg(long, default_value = "60", value_parser = seconds)]
    timeout: u64,
    /// Go through the `rcm daemon` at this socket (server and client are two sessions of it)
    /// instead of devices in this process.
    #[arg(long, value_name = "PATH")]
    daemon: Option<PathBuf>,
    /// Microseconds an idle device, callback or event-channel thread polls for work before
    /// it sleeps (0: sleep at once). Waking a sleeping thread costs tens of µs per hop.
    #[arg(long, value_name = "US", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(0..=100_000))]
    spin_us: u64,
    /// Send each datagram on its own and run the server's callbacks on callback threads. By
    /// default the calls a burst makes in a row, and the answers its event loop makes while
    /// more events are waiting, send their datagrams together (`rcm::SendBatch`: one system
    /// call per peer and batch), and the server's callbacks run on the device thread that
    /// received their event, their answers sent together (`rcm::CallbackMode::Inline`; with
    /// --daemon, on the session's reader thread). With --daemon, a burst's calls also go
    /// without waiting for the daemon's answers (`rcm::Pipeline`: a call the daemon refuses
    /// comes back as the connection's error event); this option turns that off too.
    #[arg(long)]
    no_send_batch: bool,
    /// Put the fabric's threads (the server's device thread among them) on one CPU and the
    /// client's calls and event loop on another, as the polling round trip's two ends are
    /// (the embedded default only; needs two CPUs). Unpinned, a scheduler may put the two
    /// polling ends of a one-at-a-time connect on one CPU, which then take turns through
    /// sched_yield at every hop (on a 2-vCPU VM whose kernel packs threads, --serial p50
    /// 17-21 µs that way against 11-12 pinned)
    #[arg(long)]
    pin: bool,
    /// The client's QPs: mimic (as cmtime: a QPN is invented, the connect ends with
    /// CONNECT_RESPONSE, then the tool takes the RTR and RTS attributes and calls establish,
    /// which sends the RTU) or attached (a soft QP on each id, as rdma_create_qp: rcm moves
    /// it and sends the RTU itself, and the connect ends with ESTABLISHED; the init, rtr,
    /// rts and establish rows are then empty).
    #[arg(long, default_value = "mimic", value_parser = ["mimic", "attached"], conflicts_with = "listen")]
    qp: String,
    /// Connections made, established, disconnected and destroyed one at a time before the
    /// measured run and not counted, as cmtime's warm-up: the first connections of a
    /// process pay for threads that start polling, tables and pages (at most -c; default
    /// 100, and 0 with --server, whose server, started with --listen -c N, would count
    /// them).
    #[arg(long, value_name = "N", conflicts_with = "listen",
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    warmup: Option<u32>,
    /// Threads that make a burst's calls: thread t of N calls for connections t, t+N, t+2N,
    /// ... (default 1, as cmtime). Several calling threads are how a multi-threaded
    /// application uses rcm; through --daemon their round trips to the daemon overlap.
    #[arg(long, value_name = "N", default_value_t = 1, conflicts_with_all = ["listen", "serial"],
          value_parser = clap::value_parser!(u32).range(1..=64))]
    issuers: u32,
    /// With --serial, on RoCEv2 devices of this process: also print where a connect's time
    /// goes, hop by hop, from stamps taken in the run: with the embedded default the medians
    /// of the REQ's and the REP's trips through the kernel and of rcm's work at each end;
    /// with --server (the server elsewhere) the client's own segments and the time from its
    /// REQ to the REP. The stamps read the clock about six times a connect (~0.15 µs).
    #[arg(long, requires = "serial", conflicts_with_all = ["daemon", "listen"])]
    breakdown: bool,
}

#[derive(clap::Args)]
struct DaemonArgs {
    /// Unix socket to serve on.
    #[arg(long, value_name = "PATH", default_value = "/tmp/rcm.sock")]
    socket: PathBuf,
    /// An address whose device the daemon owns (repeat for several).
    #[arg(long, value_name = "IP", required = true)]
    bind: Vec<std::net::IpAddr>,
    /// Transport of the devices.
    #[arg(long, default_value = "roce", value_parser = ["roce", "iwarp"])]
    transport: String,
    /// UDP port of the RoCEv2 devices.
    #[arg(long, default_value_t = 4791, value_parser = clap::value_parser!(u16).range(1..))]
    udp_port: u16,
    /// Callback threads (the daemon's callbacks only queue events for its clients and never
    /// wait on one: one thread is enough, and fewer threads mean fewer wake-ups).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
    /// Where the daemon's callbacks run: on the device thread that received their event
    /// (inline; see rcm::CallbackMode), on its callback threads (threads), or there with
    /// their datagrams sent together (batched). Its callbacks never block, so all three are
    /// safe. Inline saves a thread hop per event that comes from the network: on an earlier,
    /// slower 2-core VM, interleaved, serial connect p50 ~216 µs against ~288 with threads.
    /// A call's own events are queued by the thread serving it in either mode, so between two
    /// clients of a one-address daemon the two are now within noise (37-47 µs against 38-51,
    /// 6 interleaved rounds); bursts within noise.
    #[arg(long, default_value = "inline", value_parser = ["threads", "batched", "inline"])]
    callbacks: String,
    /// Microseconds an idle device, callback or client-reading thread polls for work before
    /// it sleeps (0: sleep at once). Waking a sleeping thread costs tens of µs per hop. A
    /// connect through the daemon crosses its threads several times a few hundred µs apart:
    /// 1000 keeps them awake in between (one at a time, connect p50 5-20 % lower in
    /// interleaved runs on a 2-core VM) at the cost of CPU while clients are busy.
    #[arg(long, value_name = "US", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(0..=100_000))]
    spin_us: u64,
    /// Send a device's datagrams to its own address through the kernel's UDP, as to any
    /// other address. By default they go straight to its engine (two clients connecting
    /// through one device, as rxe loops back a packet to its own address; see
    /// rcm::FabricConfig::loopback): no wake-up of the device's receive thread.
    #[arg(long)]
    no_loopback: bool,
    /// Keep clients' command channels and events on their sockets: refuse to move them into
    /// shared memory (by default a client's calls, their answers and its events pass through
    /// rings in memfds the daemon makes and seals, with no system call while both sides
    /// poll; the sockets stay as lifelines).
    #[arg(long)]
    no_shm: bool,
    /// Threads serving the channels in shared memory (default: one per four CPUs, 1 to 16).
    /// Each polls its rings (and, with nothing to serve, receives for the RoCEv2 devices,
    /// whose own threads then stand aside) before it sleeps: more than the CPUs left over
    /// from the clients slow every call down.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    ring_threads: Option<u16>,
    /// Socket file permissions, octal.
    #[arg(long, default_value = "660", value_parser = parse_mode)]
    mode: u32,
    /// Most ids one client may hold.
    #[arg(long, default_value_t = rcm_ucm::proto::Limits::default().max_ids)]
    max_ids: u32,
    /// Most events queued for one client; more are dropped and counted.
    #[arg(long, default_value_t = rcm_ucm::proto::Limits::default().max_queued_events)]
    max_queued_events: u32,
    /// Most connect requests queued unread for one client; more are rejected.
    #[arg(long, default_value_t = rcm_ucm::proto::Limits::default().max_unread_requests)]
    max_unread_requests: u32,
    /// Largest message a client may send, in bytes.
    #[arg(long, default_value_t = rcm_ucm::proto::Limits::default().max_message,
          value_parser = clap::value_parser!(u32).range(64..=1_048_576))]
    max_message: u32,
    /// Most connections served at once (sessions, their command channels, and connections
    /// still in their handshake; each holds two threads). One more is refused with
    /// LimitExceeded(Connections) and closed.
    #[arg(long, default_value_t = rcm_ucm::MAX_CONNECTIONS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    max_connections: usize,
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode like 660"))
}

fn daemon(a: &DaemonArgs) -> ExitCode {
    use rcm_ucm::{Daemon, DaemonConfig, Transport};
    // Colours for a terminal only: a log file or a service manager's journal would keep the
    // escape sequences.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(e) = signal_hook::flag::register(sig, stop.clone()) {
            eprintln!("rcm daemon: cannot handle signal {sig}: {e}");
            return ExitCode::from(2);
        }
    }
    let mut cfg = DaemonConfig::new(&a.socket, a.bind.clone());
    cfg.transport = if a.transport == "iwarp" {
        Transport::Iwarp
    } else {
        Transport::Roce
    };
    cfg.fabric.udp_port = a.udp_port;
    cfg.fabric.dispatcher_threads = a.threads as usize;
    cfg.fabric.callbacks = callback_mode(&a.callbacks);
    cfg.fabric.spin = std::time::Duration::from_micros(a.spin_us);
    cfg.fabric.loopback = !a.no_loopback;
    cfg.mode = a.mode;
    cfg.limits = rcm_ucm::proto::Limits {
        max_ids: a.max_ids,
        max_queued_events: a.max_queued_events,
        max_unread_requests: a.max_unread_requests,
        max_message: a.max_message,
    };
    cfg.max_connections = a.max_connections;
    cfg.shared_memory = !a.no_shm;
    if let Some(n) = a.ring_threads {
        cfg.ring_threads = n.into();
    }
    let d = match Daemon::start(cfg) {
        Ok(d) => d,
        Err(rcm_ucm::DaemonError::Device(ip, e)) => {
            eprintln!(
                "rcm daemon: {}",
                rcm_cli::device_error(&format!("device {ip}"), &e)
            );
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("rcm daemon: {e}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "rcm daemon: serving {:?} on {} (UDP {}); SIGTERM or Ctrl-C to stop",
        a.bind,
        a.socket.display(),
        a.udp_port
    );
    let mut held = HeldOffReport::default();
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(100));
        if let Some(warning) = held.news(rcm::process_hold_offs(), std::time::Instant::now()) {
            tracing::warn!("{warning}");
        }
    }
    eprintln!(
        "rcm daemon: stopping: {} session(s), {} id(s) to destroy",
        d.sessions(),
        d.held_ids()
    );
    for ip in d.fabric().device_addrs() {
        if let Some(dev) = d.fabric().device(ip).filter(|d| !d.is_iwarp()) {
            let (rx, tx) = dev.traffic();
            eprintln!(
                "rcm daemon: device {ip}: {tx} CM datagrams sent, {rx} received; {} of them \
                 to itself, handed to its engine without UDP (see --no-loopback)",
                dev.looped()
            );
        }
    }
    eprintln!(
        "rcm daemon: {} command channel(s) were mapped into shared memory{}",
        d.mapped_channels(),
        if a.no_shm {
            " (--no-shm)".to_string()
        } else {
            format!(
                ", served by {} ring thread(s); {} session(s) had their events mapped",
                d.ring_threads(),
                d.mapped_sessions()
            )
        }
    );
    let n = rcm::process_hold_offs();
    if n > 0 {
        eprintln!(
            "rcm daemon: its polling threads were held off polling {n} time(s) in all ({HELD_OFF_WHY})"
        );
    }
    d.shutdown();
    ExitCode::SUCCESS
}

/// What holds a polling thread off, as the daemon tells its operator.
const HELD_OFF_WHY: &str = "another process kept their CPU for over a millisecond at a time, \
     and they slept instead: clients' calls waited for them to wake; a CPU of the daemon's own \
     avoids it";

/// The daemon's warnings that its polling threads were held off (`rcm::process_hold_offs`):
/// at most one every [`HeldOffReport::EVERY`], for the hold-offs since the one before.
#[derive(Default)]
struct HeldOffReport {
    /// The count at the last warning.
    seen: u64,
    /// When the last warning was logged.
    at: Option<std::time::Instant>,
}

impl HeldOffReport {
    /// The shortest time between two warnings.
    const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    /// The warning to log, given the count now (`n`), if threads were held off since the
    /// last one and that was at least [`HeldOffReport::EVERY`] ago.
    fn news(&mut self, n: u64, now: std::time::Instant) -> Option<String> {
        if n == self.seen || self.at.is_some_and(|t| now < t + Self::EVERY) {
            return None;
        }
        let warning = format!(
            "polling threads held off polling {} time(s) since {} ({HELD_OFF_WHY})",
            n.saturating_sub(self.seen),
            if self.at.is_some() {
                "the last warning"
            } else {
                "the start"
            }
        );
        self.seen = n;
        self.at = Some(now);
        Some(warning)
    }
}

#[derive(clap::Args)]
struct PingArgs {
    /// Serve connections.
    #[arg(long, conflicts_with = "connect")]
    listen: bool,
    /// Connect to a server at this address.
    #[arg(long, value_name = "IP")]
    connect: Option<std::net::IpAddr>,
    /// This side's address (its device). Defaults: server 127.0.0.1; client 127.0.0.2 toward
    /// a loopback server (127.0.0.1 toward 127.0.0.2), else the address the routing table
    /// picks for --connect. With neither --listen nor --connect, both ends use this one
    /// device (e.g. `--bind ::1`); by default they are 127.0.0.1 and 127.0.0.2.
    #[arg(long, value_name = "IP")]
    bind: Option<std::net::IpAddr>,
    /// rdma_cm port (default 7471 for tcp, 7174 for udp, as the kernel tools).
    #[arg(short = 'p', long, value_parser = clap::value_parser!(u16).range(1..))]
    port: Option<u16>,
    /// Connections (server: 0 = serve forever; a client needs at least 1; at most 1,000,000).
    #[arg(short = 'c', long, default_value_t = 1)]
    count: usize,
    /// Transport.
    #[arg(long, default_value = "roce", value_parser = ["roce", "iwarp"])]
    transport: String,
    /// Port space: tcp (RC: REQ/REP/RTU) or udp (UD: SIDR).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "udp"])]
    ps: String,
    /// Server: reject every request (with the private data) instead of accepting.
    #[arg(long)]
    reject: bool,
    /// Private data of the rejects (server: sent; client: expected), when it differs from
    /// --private-data.
    #[arg(long, value_name = "TEXT")]
    reject_data: Option<String>,
    /// Private data to send and expect back.
    #[arg(long, default_value = "rcm ping")]
    private_data: String,
    /// Messages per connection: iWARP, exchanged each way over the stream (default 1, at
    /// most 1,024: each side sends all before it reads, and the peer queues that many);
    /// `--ps udp`, UD datagrams the client sends and the server answers, as udaddy's `-C`
    /// (default 10; through a daemon 0). 0 = the CM only (for `ucmatose -C 0`,
    /// `udaddy -C 0`).
    #[arg(short = 'C', long, value_name = "N")]
    messages: Option<usize>,
    /// The same as `--messages 0`.
    #[arg(long, conflicts_with = "messages")]
    no_messages: bool,
    /// `--ps udp`: bytes per UD datagram, as udaddy's `-S`.
    #[arg(short = 'S', long, default_value_t = rcm_cli::ping::UD_DEFAULT_SIZE)]
    size: usize,
    /// iWARP: MPA revision of this side (2: RFC 6581 with IRD/ORD; 1: RFC 5044 only, for
    /// initiating and answering).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    mpa_version: u8,
    /// UDP port of the RoCEv2 devices.
    #[arg(long, default_value_t = 4791, value_parser = clap::value_parser!(u16).range(1..))]
    udp_port: u16,
    /// Give up after this long: seconds, or a number with a unit (90s, 5m, 1h; at most a
    /// day).
    #[arg(long, default_value = "60", value_parser = seconds)]
    timeout: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Go through the `rcm daemon` at this socket instead of devices in this process.
    #[arg(long, value_name = "PATH")]
    daemon: Option<PathBuf>,
}

fn ping(a: &PingArgs) -> ExitCode {
    use rcm_cli::ping;
    let ps = if a.ps == "udp" {
        rcm::PortSpace::Udp
    } else {
        rcm::PortSpace::Tcp
    };
    let o = ping::PingOpts {
        listen: if a.listen {
            Some(true)
        } else if a.connect.is_some() {
            Some(false)
        } else {
            None
        },
        connect: a.connect,
        bind: a.bind,
        port: a.port.unwrap_or(ps_default_port(ps)),
        count: a.count,
        ps,
        reject: a.reject,
        reject_data: a.reject_data.as_ref().map(|d| d.as_bytes().to_vec()),
        private_data: a.private_data.as_bytes().to_vec(),
        udp_port: a.udp_port,
        timeout: std::time::Duration::from_secs(a.timeout),
        daemon: a.daemon.clone(),
        iwarp: a.transport == "iwarp",
        messages: match (a.no_messages, a.messages) {
            (true, _) => 0,
            (false, Some(n)) => n,
            (false, None) if ps == rcm::PortSpace::Udp && a.transport == "roce" => {
                if a.daemon.is_some() {
                    0
                } else {
                    ping::UD_DEFAULT_MESSAGES
                }
            }
            (false, None) => 1,
        },
        size: a.size,
        mpa_version: a.mpa_version,
    };
    let r = match ping::run(&o, !a.json) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rcm ping: {e}");
            return ExitCode::from(2);
        }
    };
    if a.json {
        println!("{}", serde_json::to_string(&r).unwrap_or_default());
    } else {
        println!(
            "rcm ping: {}: {} of {} established, {} disconnected, {} rejected, private data matched {} time(s)",
            r.role, r.established, r.connections, r.disconnected, r.rejected, r.private_data_ok
        );
        if r.unconfirmed > 0 {
            println!(
                "rcm ping: {}: {} accepted connection(s) never confirmed by the client (REP timeout: the client went away, or all its RTUs were lost)",
                r.role, r.unconfirmed
            );
        }
        if r.closed_by_client > 0 {
            println!(
                "rcm ping: {}: {} established connection(s) the server left open for 10 s, disconnected by the client (under loss: the server gave up on its REP)",
                r.role, r.closed_by_client
            );
        }
        if a.transport == "iwarp" && o.messages > 0 {
            println!(
                "rcm ping: messages over the iWARP stream received {} of {} ({} checked byte for byte, {} from a peer not in rcm's format)",
                r.messages_ok + r.messages_unverified,
                r.messages_expected,
                r.messages_ok,
                r.messages_unverified
            );
        } else if ps == rcm::PortSpace::Udp && o.messages > 0 {
            println!(
                "rcm ping: UD datagrams received {} of {} ({} checked byte for byte, {} from a peer not in rcm's format)",
                r.messages_ok + r.messages_unverified,
                r.messages_expected,
                r.messages_ok,
                r.messages_unverified
            );
        }
        for e in &r.errors {
            println!("rcm ping: error: {e}");
        }
    }
    if r.ok(a.reject) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[derive(clap::Args)]
struct StressArgs {
    /// How long to run: seconds, or a number with a unit (30s, 5m, 2h; at most a day).
    #[arg(short = 'd', long, default_value = "10", value_parser = seconds)]
    duration: u64,
    /// Worker threads.
    #[arg(short = 't', long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: u32,
    /// Seed of the random choices (printed, so a run can be repeated).
    #[arg(long)]
    seed: Option<u64>,
    /// UDP port of the loopback devices.
    #[arg(long, default_value_t = 4791, value_parser = clap::value_parser!(u16).range(1..))]
    udp_port: u16,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Stress the `rcm daemon` at this socket (device removal is then not exercised).
    #[arg(long, value_name = "PATH")]
    daemon: Option<PathBuf>,
    /// Transport of the in-process devices: roce (RoCEv2 CM over UDP) or iwarp (MPA over
    /// TCP, one stream per connection). A daemon serves the transport it was started with.
    #[arg(long, default_value = "roce", value_parser = ["roce", "iwarp"], conflicts_with = "daemon")]
    transport: String,
    /// Where callbacks run: on callback threads (threads), there with their datagrams sent
    /// together (batched), or on the device thread that received their event (inline; with
    /// --daemon, on the session's reader thread); see rcm::CallbackMode. The stress
    /// callbacks never block, so all three apply.
    #[arg(long, default_value = "threads", value_parser = ["threads", "batched", "inline"])]
    callbacks: String,
}

/// A length of time on the command line, in whole seconds: a plain number is seconds, or
/// one with a unit `s`, `m` or `h`; from one second to a day.
fn seconds(v: &str) -> Result<u64, String> {
    const DAY: u64 = 86_400;
    let bad = || format!("`{v}`: expected seconds, or a number with s, m or h");
    let t = v.trim();
    let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let scale = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3_600,
        _ => return Err(bad()),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    match n.checked_mul(scale) {
        Some(0) => Err("must be at least 1 s".into()),
        Some(secs) if secs <= DAY => Ok(secs),
        _ => Err(format!("`{v}` is more than a day ({DAY} s)")),
    }
}

/// A `--callbacks` value (checked by clap) as a mode.
fn callback_mode(s: &str) -> rcm::CallbackMode {
    match s {
        "batched" => rcm::CallbackMode::BatchedThreads,
        "inline" => rcm::CallbackMode::Inline,
        _ => rcm::CallbackMode::Threads,
    }
}

fn stress(a: &StressArgs) -> ExitCode {
    let seed = a.seed.unwrap_or_else(rand::random);
    let o = rcm_cli::stress::StressOpts {
        duration: std::time::Duration::from_secs(a.duration),
        threads: a.threads as usize,
        seed,
        udp_port: a.udp_port,
        daemon: a.daemon.clone(),
        callbacks: callback_mode(&a.callbacks),
        iwarp: a.transport == "iwarp",
    };
    if !a.json {
        println!(
            "rcm stress: {} threads for {} s, seed {seed}{}",
            a.threads,
            a.duration,
            if o.iwarp { ", iWARP devices" } else { "" }
        );
    }
    let r = match rcm_cli::stress::run(&o) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rcm stress: {e}");
            return ExitCode::from(2);
        }
    };
    if a.json {
        println!("{}", serde_json::to_string(&r).unwrap_or_default());
    } else {
        println!(
            "ids created {} ({} channel-mode)  established {}  rejected {}  disconnected {}  destroys {} (deferred {}; refused while an event was held {})  non-blocking destroys {}  device removals {}  callbacks {}  channel events {}  contexts {}/{} dropped",
            r.created, r.channel_ids, r.established, r.rejected, r.disconnected, r.destroys, r.deferred,
            r.refused_while_held, r.begin_destroys, r.removals, r.callbacks, r.channel_events,
            r.contexts.1, r.contexts.0
        );
        for i in &r.invariants {
            println!("checked: {i}");
        }
        for v in &r.violations {
            println!("VIOLATION: {v}");
        }
    }
    if r.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// An iWARP connection is a TCP socket at each end this process runs: a burst that needs
/// more descriptors than the process may open would fail at its end with EMFILE (connects
/// refused, requests rejected). Said before the run instead, with what would fit.
fn iwarp_descriptors_short(o: &rcm_cli::bench::BenchOpts) -> Option<String> {
    // Devices, listeners, the dispatcher's and the tool's own descriptors.
    const SPARE: u64 = 256;
    if !o.iwarp || o.daemon.is_some() {
        return None;
    }
    let ends: u64 = if o.listen || o.server.is_some() { 1 } else { 2 };
    let limit = rcm_cli::raise_fd_limit()?;
    let n = if o.serial { 1 } else { o.connections as u64 };
    let need = n.saturating_mul(ends).saturating_add(SPARE);
    (need > limit).then(|| {
        format!(
            "{n} iWARP connections in flight need about {need} open files here (a TCP socket \
             at each of the {ends} end(s) this process runs), more than it may open ({limit}, \
             the hard limit: ulimit -Hn); give -c {} or fewer, raise the limit, or run the two \
             ends as two processes (--listen and --server)",
            limit.saturating_sub(SPARE) / ends
        )
    })
}

fn ps_default_port(ps: rcm::PortSpace) -> u16 {
    ps.default_port()
}

fn main() -> ExitCode {
    fix_mmap_threshold();
    rcm_cli::raise_fd_limit();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Decode {
            file,
            verbose,
            json,
        } => decode(&file, verbose, json),
        Cmd::Bench(a) => bench(&a),
        Cmd::Ping(a) => ping(&a),
        Cmd::Stress(a) => stress(&a),
        Cmd::Daemon(a) => daemon(&a),
    }
}

/// Keeps glibc's mmap threshold at its initial 128 KiB unless the user set one
/// (`MALLOC_MMAP_THRESHOLD_`). By default glibc raises it each time a mapped block is freed,
/// so once a burst's tables have grown the next large blocks come from the heap, and what
/// is freed there stays in the process. Interleaved runs on a 2-core VM, 100,000
/// connections, client process alone: 1,076–1,244 bytes of RSS per connection that way,
/// 959–1,144 with it fixed; bursts of 10,000 (both ends) 2,403–2,561 against 2,245–2,427,
/// at the same rates within the VM's noise.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn fix_mmap_threshold() {
    const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
    extern "C" {
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt only sets a parameter of glibc's allocator (under its lock); it is
        // called before this program allocates anything large and touches no memory it holds.
        unsafe { mallopt(M_MMAP_THRESHOLD, 128 * 1024) };
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn fix_mmap_threshold() {}

fn bench(a: &BenchArgs) -> ExitCode {
    use rcm_cli::bench;
    if !a.bind.is_empty() && !a.listen && a.server.is_none() && a.daemon.is_none() {
        // The embedded run's devices are fixed (127.0.0.1 serves, 127.0.0.2 and up connect):
        // an address given here would be ignored.
        eprintln!(
            "rcm bench: --bind picks a side's address with --listen, --server or --daemon; \
             the embedded run's devices are 127.0.0.1 (server) and 127.0.0.2 on (client; \
             for other addresses, run `rcm bench --listen --bind IP` and \
             `rcm bench --server IP` in two processes, \
             or, for one address such as ::1, `rcm daemon --bind IP` and \
             `rcm bench --daemon PATH`)"
        );
        return ExitCode::from(2);
    }
    let mut bind = a.bind.clone();
    if bind.is_empty() && a.daemon.is_none() {
        if a.listen {
            bind.push(std::net::Ipv4Addr::LOCALHOST.into());
        } else if let Some(server) = a.server {
            match rcm_cli::default_source(server) {
                Ok(b) => bind.push(b),
                Err(e) => {
                    eprintln!("rcm bench: {e}");
                    return ExitCode::from(2);
                }
            }
        }
    }
    let o = bench::BenchOpts {
        connections: a.connections.unwrap_or(1000) as usize,
        serve: a.connections.filter(|_| a.listen).map(|c| c as usize),
        json: a.json,
        serial: a.serial,
        listen: a.listen,
        server: a.server,
        bind,
        port: a.port,
        udp_port: a.udp_port,
        threads: a.threads as usize,
        baseline_tcp: a.baseline.is_some(),
        progress: !a.json && std::io::IsTerminal::is_terminal(&std::io::stderr()),
        step_timeout: std::time::Duration::from_secs(a.timeout),
        daemon: a.daemon.clone(),
        iwarp: a.transport == "iwarp",
        spin: std::time::Duration::from_micros(a.spin_us),
        send_batch: !a.no_send_batch,
        pin: a.pin,
        attached_qp: a.qp == "attached",
        warmup: a.warmup.unwrap_or(if a.server.is_some() { 0 } else { 100 }) as usize,
        issuers: a.issuers as usize,
        breakdown: a.breakdown,
    };
    if o.breakdown && o.iwarp {
        eprintln!(
            "rcm bench: --breakdown stamps the hops of RoCEv2 devices (an iWARP connect is \
             TCP's handshake and the MPA exchange, which it does not see)"
        );
        return ExitCode::from(2);
    }
    if let Some(e) = iwarp_descriptors_short(&o) {
        eprintln!("rcm bench: {e}");
        return ExitCode::from(2);
    }
    // Created before the run: a long run must not end in "cannot write".
    let mut plot = match &a.plot {
        Some(p) => match std::fs::File::create(p) {
            Ok(f) => Some((p, f)),
            Err(e) => {
                eprintln!("rcm bench: cannot write the plot to {}: {e}", p.display());
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let r = if a.listen || a.server.is_some() {
        bench::run_remote(&o)
    } else if o.daemon.is_some() {
        bench::run_daemon(&o)
    } else {
        bench::run_local(&o)
    };
    let r = match r {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rcm bench: {e}");
            return ExitCode::from(2);
        }
    };
    let r = match r {
        bench::Ran::Client(r) => *r,
        bench::Ran::Served { clean: true } => return ExitCode::SUCCESS,
        bench::Ran::Served { clean: false } => return ExitCode::FAILURE,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
    } else {
        bench::print_table(&r);
    }
    if let Some((p, f)) = &mut plot {
        if let Err(e) = bench::write_plot(&r, f) {
            eprintln!("rcm bench: writing {}: {e}", p.display());
            return ExitCode::from(2);
        }
    }
    if r.errors == 0 && r.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn decode(file: &std::path::Path, verbose: bool, json: bool) -> ExitCode {
    let (records, totals, warning) = match rcm_cli::decode::decode_file(file) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("rcm decode: {e}");
            return ExitCode::from(2);
        }
    };
    let mut out = String::new();
    for r in &records {
        if json {
            let mut r = r.clone();
            if r.detail.is_none() {
                r.detail = Some(serde_json::Value::Null);
            }
            out.push_str(&serde_json::to_string(&r).unwrap_or_default());
            out.push('\n');
        } else {
            out.push_str(&r.line());
            out.push('\n');
            if verbose {
                if let Some(d) = &r.detail {
                    for l in rcm_cli::decode::verbose_lines(d) {
                        out.push_str("        ");
                        out.push_str(&l);
                        out.push('\n');
                    }
                }
            }
        }
    }
    print!("{out}");
    if let Some(w) = &warning {
        eprintln!("rcm decode: warning: {w}");
    }
    eprintln!(
        "rcm decode: {} frames, {} messages, {} corrupt, {} other frames skipped",
        totals.frames, totals.records, totals.errors, totals.skipped
    );
    // A cut file was not decoded whole: not a clean result either.
    if totals.errors > 0 || warning.is_some() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::{seconds, HeldOffReport};
    use std::time::{Duration, Instant};

    #[test]
    fn lengths_of_time_take_seconds_or_a_unit_from_a_second_to_a_day() {
        for (v, want) in [
            ("45", 45),
            ("45s", 45),
            ("2m", 120),
            ("1h", 3_600),
            ("24h", 86_400),
        ] {
            assert_eq!(seconds(v), Ok(want), "{v}");
        }
        for (v, says) in [
            ("0", "at least 1 s"),
            ("0m", "at least 1 s"),
            ("86401", "more than a day"),
            ("25h", "more than a day"),
            ("99999999999999999999h", "expected seconds"),
            ("2d", "expected seconds"),
            ("1.5s", "expected seconds"),
            ("s", "expected seconds"),
            ("", "expected seconds"),
            ("-3", "expected seconds"),
        ] {
            let e = seconds(v).expect_err(v);
            assert!(e.contains(says), "{v}: {e}");
        }
    }

    #[test]
    fn the_daemon_warns_of_new_hold_offs_at_most_every_ten_seconds() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut r = HeldOffReport::default();
        assert_eq!(r.news(0, t), None, "none yet");
        let first = r.news(3, t).expect("the first");
        assert!(first.contains("3 time(s) since the start"), "{first}");
        assert_eq!(r.news(5, t + s(9)), None, "within 10 s of the last");
        let second = r.news(6, t + s(10)).expect("10 s on");
        assert!(
            second.contains("3 time(s) since the last warning"),
            "{second}"
        );
        assert_eq!(r.news(6, t + s(60)), None, "nothing new");
    }
}
