//! `rcm ping`: connections with private data checked byte for byte both ways, as
//! ucmatose/udaddy do. The server disconnects each connection once it is established (as
//! `ucmatose -C 0` does), so rcm interoperates with the kernel's tools in both roles.
//!
//! Over iWARP (`iwarp`) each established connection also carries one real message each way
//! (or `messages` of them) before the server disconnects: the client sends "ping " + the
//! private data as an RDMAP Send, the server "pong " + the private data, and each side checks
//! what it got. Each side sends all of its messages before it waits for the peer's, as
//! `ucmatose` does; a `ucmatose` peer's messages (its buffer, whatever it holds) are counted,
//! not checked.
//!
//! With `--ps udp` (SIDR) each resolved service also carries UD datagrams, as rdma-core's
//! `udaddy` does (`-C` messages of `-S` bytes, defaults 10 and 100): the client sends
//! `messages` UD SENDs with immediate data (its QPN, which `udaddy`'s server answers to) and
//! waits for as many replies; the server receives them and answers each one to the QPN in
//! its immediate data (or its DETH source QP), with rdma_cm's Q_Key. rcm's message is
//! `"ping <seq> "` + the private data, zero-padded to the size; rcm's answer is the same bytes
//! with "pong" in front instead of "ping", and each side checks those byte for byte. A
//! kernel peer's payloads are counted but cannot be checked: `udaddy`'s client sends an
//! uninitialised buffer, and its server answers with its receive buffer (the 40-byte GRH rxe
//! writes, then the start of the last message received).

use rcm::{
    AcceptOptions, CmId, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, PortSpace,
    State,
};
use serde::Serialize;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// What to do.
#[derive(Debug, Clone)]
pub struct PingOpts {
    /// Serve (`Some(true)`), connect (`Some(false)`), or both in this process (`None`).
    pub listen: Option<bool>,
    /// Server address when connecting.
    pub connect: Option<IpAddr>,
    /// This side's device address.
    pub bind: Option<IpAddr>,
    /// rdma_cm port.
    pub port: u16,
    /// Connections (0 = serve forever).
    pub count: usize,
    /// Port space (TCP → RC with REQ/REP; UDP → SIDR).
    pub ps: PortSpace,
    /// Server rejects every request (with the private data) instead of accepting.
    pub reject: bool,
    /// Private data sent (and expected back).
    pub private_data: Vec<u8>,
    /// Private data of rejects (sent by a `--reject` server, expected by the client);
    /// `None`: `private_data`.
    pub reject_data: Option<Vec<u8>>,
    /// UDP port of the RoCEv2 devices.
    pub udp_port: u16,
    /// Overall time limit.
    pub timeout: Duration,
    /// Use the `rcm daemon` at this socket instead of devices in this process.
    pub daemon: Option<std::path::PathBuf>,
    /// iWARP devices (MPA over TCP) instead of RoCEv2, with a message exchange.
    pub iwarp: bool,
    /// Messages per connection and side: iWARP, messages exchanged over the stream (1 by
    /// default; 0: the CM only, as against `ucmatose -C 0`); UD, datagrams the client sends
    /// and the server answers (udaddy's `-C`; 0: SIDR only, as against `udaddy -C 0`).
    pub messages: usize,
    /// UD: bytes per datagram (udaddy's `-S`).
    pub size: usize,
    /// iWARP: the MPA revision this side's devices speak (2, or 1: RFC 5044 only, initiating
    /// and answering with revision 1).
    pub mpa_version: u8,
}

/// udaddy's defaults: `-C 10`, `-S 100`.
pub const UD_DEFAULT_MESSAGES: usize = 10;
/// udaddy's default message size.
pub const UD_DEFAULT_SIZE: usize = 100;

/// How long either side waits for the other's message once established.
const MESSAGE_WAIT: Duration = Duration::from_secs(10);

/// The message the client sends (and the server expects) over an iWARP connection.
fn ping_message(pd: &[u8]) -> Vec<u8> {
    [b"ping ".as_slice(), pd].concat()
}

/// The server's answer.
fn pong_message(pd: &[u8]) -> Vec<u8> {
    [b"pong ".as_slice(), pd].concat()
}

/// The iWARP message exchange of one connection: this side's `n` messages go out first, then
/// the peer's `n` are taken, the order rdma-core's `ucmatose` uses (its server sends all, then
/// receives; its client receives all, then answers), so rcm interoperates with it in both
/// roles (a send-one-then-wait server waited out `MESSAGE_WAIT` for each message of a
/// `ucmatose` client, which answers only once it has them all). A message in rcm's format
/// (starting with `want`'s "ping " or "pong ") must equal `want` byte for byte; another is
/// a kernel tool's (`ucmatose` sends whatever its buffer holds), counted but not checked.
/// Errors go to the report.
fn exchange(
    id: &CmId,
    n: usize,
    (send, want): (&[u8], &[u8]),
    who: &str,
    r: &mut PingReport,
    log: bool,
) {
    r.messages_expected += n;
    for _ in 0..n {
        if let Err(e) = id.send(send) {
            r.errors.push(format!("{who}: send: {e}"));
            return;
        }
    }
    let prefix = want.get(..5).unwrap_or(want);
    for _ in 0..n {
        match id.recv_message(MESSAGE_WAIT) {
            Some(m) if m == want => {
                r.messages_ok += 1;
                if log {
                    println!(
                        "rcm ping: {who}: message exchanged: sent {:?}, received {:?}",
                        String::from_utf8_lossy(send),
                        String::from_utf8_lossy(&m)
                    );
                }
            }
            Some(m) if m.starts_with(prefix) => r.errors.push(format!(
                "{who}: message differs: {:?}",
                String::from_utf8_lossy(&m)
            )),
            Some(m) => {
                r.messages_unverified += 1;
                if log {
                    println!(
                        "rcm ping: {who}: received {} bytes not in rcm's format (a kernel \
                         tool's buffer), not checked",
                        m.len()
                    );
                }
            }
            None => {
                r.errors.push(format!("{who}: no message from the peer"));
                return;
            }
        }
    }
}

/// rcm's UD message number `seq`: `"ping <seq> "` + the private data, zero-padded (or cut) to
/// `size` bytes.
fn ud_message(seq: usize, pd: &[u8], size: usize) -> Vec<u8> {
    let mut m = [format!("ping {seq} ").as_bytes(), pd].concat();
    m.resize(size, 0);
    m
}

/// The sequence number of an rcm UD message or answer (`"ping <seq> "` / `"pong <seq> "`), if
/// the payload has that shape.
fn ud_seq(payload: &[u8], word: &str) -> Option<usize> {
    let rest = payload.strip_prefix(word.as_bytes())?.strip_prefix(b" ")?;
    let end = rest.iter().position(|&b| b == b' ')?;
    std::str::from_utf8(&rest[..end]).ok()?.parse().ok()
}

/// The answer to a UD message: rcm's "ping" becomes "pong"; anything else is echoed (its
/// length kept: the peer's receive buffers are as long as what it sends).
fn ud_answer(payload: &[u8]) -> Vec<u8> {
    match payload.strip_prefix(b"ping") {
        Some(rest) => [b"pong".as_slice(), rest].concat(),
        None => payload.to_vec(),
    }
}

/// The server's side of a UD service: receives `o.messages` datagrams on the accepted child
/// and answers each (as `udaddy`'s server does, to the QPN in the immediate data).
fn ud_serve(id: &CmId, o: &PingOpts, r: &mut PingReport, log: bool) {
    let Some(qpn) = id.qp_num() else {
        r.errors
            .push("server: the accepted UD id has no QPN".into());
        return;
    };
    r.messages_expected += o.messages;
    // From the accept (a `-c 0` server has no overall deadline).
    let end = Instant::now() + MESSAGE_WAIT;
    let (mut ok, mut unverified) = (0usize, 0usize);
    for k in 0..o.messages {
        let left = end.saturating_duration_since(Instant::now());
        let Some(m) = id.recv_ud(left) else {
            r.errors.push(format!(
                "server: received {k} of {} UD datagrams from {:?}",
                o.messages,
                id.peer_addr()
            ));
            break;
        };
        match ud_seq(&m.payload, "ping") {
            Some(seq) if m.payload == ud_message(seq, &o.private_data, m.payload.len()) => {
                ok += 1;
            }
            Some(seq) => r.errors.push(format!(
                "server: UD message {seq} differs: {:02x?}",
                m.payload
            )),
            None => unverified += 1,
        }
        let to = rcm::UdParam {
            qpn: m.imm.unwrap_or(m.src_qpn) & 0xFF_FFFF,
            qkey: rcm_wire::cma::RDMA_UDP_QKEY,
        };
        if let Err(e) = id.send_ud_with_imm(m.src, to, qpn, &ud_answer(&m.payload)) {
            r.errors.push(format!("server: UD answer: {e}"));
        }
    }
    r.messages_ok += ok;
    r.messages_unverified += unverified;
    if log {
        println!(
            "rcm ping: server: UD datagrams from {:?}: {} received ({ok} rcm's, checked; \
             {unverified} not in rcm's format, not checked), each answered",
            id.peer_addr(),
            ok + unverified
        );
    }
}

/// The client's side: sends `o.messages` datagrams to the resolved service and receives as
/// many answers.
fn ud_exchange(
    id: &CmId,
    (dst, ud): (IpAddr, rcm::UdParam),
    o: &PingOpts,
    who: &str,
    r: &mut PingReport,
    deadline: Instant,
    log: bool,
) {
    let Some(qpn) = id.qp_num() else {
        r.errors.push(format!("{who}: the UD id has no QPN"));
        return;
    };
    r.messages_expected += o.messages;
    let mut want: HashMap<usize, Vec<u8>> = HashMap::new();
    for seq in 0..o.messages {
        let m = ud_message(seq, &o.private_data, o.size);
        // udaddy sends its QPN as immediate data; its server answers to that QPN.
        if let Err(e) = id.send_ud_with_imm(dst, ud, qpn, &m) {
            r.errors.push(format!("{who}: UD send {seq}: {e}"));
            return;
        }
        want.insert(seq, ud_answer(&m));
    }
    let end = deadline.min(Instant::now() + MESSAGE_WAIT);
    let (mut ok, mut unverified) = (0usize, 0usize);
    for k in 0..o.messages {
        let left = end.saturating_duration_since(Instant::now());
        let Some(m) = id.recv_ud(left) else {
            r.errors
                .push(format!("{who}: received {k} of {} UD answers", o.messages));
            break;
        };
        match ud_seq(&m.payload, "pong") {
            Some(seq) if want.get(&seq) == Some(&m.payload) => {
                want.remove(&seq);
                ok += 1;
            }
            Some(seq) => r.errors.push(format!(
                "{who}: UD answer {seq} differs: {:02x?}",
                m.payload
            )),
            None => unverified += 1,
        }
    }
    r.messages_ok += ok;
    r.messages_unverified += unverified;
    if log {
        println!(
            "rcm ping: {who}: sent {} UD datagrams of {} bytes to QPN {:#x}; {} answers \
             received ({ok} rcm's, checked; {unverified} not in rcm's format, not checked)",
            o.messages,
            o.size,
            ud.qpn,
            ok + unverified
        );
    }
}

/// What happened.
#[derive(Debug, Default, Clone, Serialize)]
pub struct PingReport {
    /// "server", "client" or "both".
    pub role: String,
    /// Connections asked for.
    pub connections: usize,
    /// Established.
    pub established: usize,
    /// Rejected (as asked, with `--reject`).
    pub rejected: usize,
    /// Disconnected cleanly.
    pub disconnected: usize,
    /// Server: accepted connections the client never confirmed (the REP timed out). Under
    /// loss IBTA allows it (the client may even hold the connection, its RTUs lost, and end
    /// it later), so it is reported apart from the errors; the run still fails, as not every
    /// connection was established here.
    pub unconfirmed: usize,
    /// Client: established connections the server left open for 10 s, which the client
    /// then disconnected itself. Under loss IBTA allows it (every REP retry of a server
    /// whose RTUs were lost died, and it gave up), so it is reported apart from the errors
    /// and counts as disconnected; against a server that never disconnects, every
    /// connection shows here.
    pub closed_by_client: usize,
    /// Private-data checks that matched byte for byte.
    pub private_data_ok: usize,
    /// Messages received (iWARP: over the stream; UD: datagrams) that matched byte for byte.
    pub messages_ok: usize,
    /// Messages received (UD datagrams, iWARP messages) that are not in rcm's format (a
    /// kernel tool's), so not checked.
    pub messages_unverified: usize,
    /// Messages expected (per connection and side: iWARP `messages`, UD `messages`).
    pub messages_expected: usize,
    /// Everything that went wrong, with the event and reason.
    pub errors: Vec<String>,
}

impl PingReport {
    /// Whether the run did exactly what was asked.
    pub fn ok(&self, reject: bool) -> bool {
        if !self.errors.is_empty() {
            return false;
        }
        if reject {
            self.rejected == self.connections
        } else {
            self.established == self.connections
                && self.disconnected == self.connections
                && self.messages_ok + self.messages_unverified == self.messages_expected
        }
    }
}

/// Counts client `i`'s connection rejected (`why`), checking it was the server's reject as
/// asked, with the expected private data.
fn client_rejected(
    r: &mut PingReport,
    o: &PingOpts,
    i: usize,
    why: &str,
    by_server: bool,
    private_data: &[u8],
    log: bool,
) {
    r.rejected += 1;
    if !o.reject {
        r.errors.push(format!("client {i}: rejected, {why}"));
    } else if !by_server {
        r.errors.push(format!(
            "client {i}: rejected with {why}, not by the server's reject"
        ));
    } else if pd_matches(private_data, reject_pd(o)) {
        r.private_data_ok += 1;
    } else {
        r.errors.push(format!(
            "client {i}: reject private data differs: {:02x?}",
            &private_data[..reject_pd(o).len().min(private_data.len())]
        ));
    }
    if log {
        println!("rcm ping: client {i}: rejected, {why}");
    }
}

/// The private data of a reject.
fn reject_pd(o: &PingOpts) -> &[u8] {
    o.reject_data.as_deref().unwrap_or(&o.private_data)
}

fn pd_matches(got: &[u8], want: &[u8]) -> bool {
    // The wire carries no length: the area is zero-padded past what was sent.
    got.len() >= want.len()
        && &got[..want.len()] == want
        && got[want.len()..].iter().all(|&b| b == 0)
}

fn ud(ps: PortSpace) -> bool {
    matches!(ps, PortSpace::Udp | PortSpace::Ipoib)
}

/// Runs the server side on `fabric` with events on `ch`; returns when `count` connections
/// finished (never with 0) or the time is up.
fn server_loop(
    ch: &EventChannel,
    listener: &CmId,
    o: &PingOpts,
    r: &mut PingReport,
    deadline: Instant,
    log: bool,
) {
    let mut finished = 0usize;
    // Children that reported ESTABLISHED.
    let mut up = std::collections::HashSet::new();
    // iWARP without messages: connections to disconnect once their grace is over, unless
    // the client disconnects first (see IWARP_GRACE).
    let mut later: Vec<(Instant, CmId)> = Vec::new();
    while o.count == 0 || finished < o.count {
        if o.count == 0 {
            // Serving forever, it never reaches the report that prints its errors: each is
            // printed (on standard error, in either output mode) as it comes, and let go.
            for e in r.errors.drain(..) {
                eprintln!("rcm ping: error: {e}");
            }
        }
        let now = Instant::now();
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() && o.count != 0 {
            r.errors.push(format!(
                "server: timed out after {finished} of {} connections",
                o.count
            ));
            break;
        }
        for (_, id) in later.iter().filter(|(at, _)| *at <= now) {
            if let Err(err) = id.disconnect() {
                if id.state() != rcm::State::Disconnect {
                    r.errors.push(format!("server: disconnect: {err}"));
                    finished += 1;
                }
            }
        }
        later.retain(|(at, _)| *at > now);
        let mut wait = if o.count == 0 {
            Duration::from_secs(3600)
        } else {
            left
        };
        if let Some(next) = later.iter().map(|(at, _)| *at).min() {
            wait = wait.min(next.saturating_duration_since(now));
        }
        let Some(e) = ch.get_event(Some(wait)) else {
            continue;
        };
        let id = e.id().clone();
        // A served connection that is over is released at once (a -c 0 server runs forever).
        let mut release = false;
        match e.event() {
            Event::ConnectRequest { private_data, .. } => {
                if pd_matches(private_data, &o.private_data) {
                    r.private_data_ok += 1;
                } else {
                    r.errors.push(format!(
                        "server: request private data differs: {:02x?}",
                        &private_data[..o.private_data.len().min(private_data.len())]
                    ));
                }
                if o.reject {
                    if let Err(err) = id.reject(reject_pd(o)) {
                        r.errors.push(format!("server: reject: {err}"));
                    }
                    r.rejected += 1;
                    finished += 1;
                    release = true;
                } else if let Err(err) = id.accept(&AcceptOptions {
                    private_data: o.private_data.clone(),
                    ..AcceptOptions::default()
                }) {
                    r.errors.push(format!("server: accept: {err}"));
                    finished += 1;
                    release = true;
                } else if ud(o.ps) {
                    r.established += 1;
                    if o.messages > 0 {
                        ud_serve(&id, o, r, log);
                    }
                    r.disconnected += 1;
                    finished += 1;
                    release = true;
                }
            }
            Event::Established { .. } => {
                r.established += 1;
                up.insert(id.key());
                if log {
                    println!("rcm ping: server: established with {:?}", id.peer_addr());
                }
                if o.iwarp {
                    let pd = &o.private_data;
                    let (pong, ping) = (pong_message(pd), ping_message(pd));
                    exchange(&id, o.messages, (&pong, &ping), "server", r, log);
                }
                if o.iwarp && o.messages == 0 {
                    later.push((Instant::now() + IWARP_GRACE, id.clone()));
                } else if let Err(err) = id.disconnect() {
                    r.errors.push(format!("server: disconnect: {err}"));
                    finished += 1;
                }
            }
            Event::Disconnected => {
                later.retain(|(_, l)| *l != id);
                // A DREQ while our REP is unconfirmed (the RTUs were lost): the client had
                // the connection up, so it was established, as rdma_cm reports only
                // DISCONNECTED in that case.
                if !up.remove(&id.key()) {
                    r.established += 1;
                }
                r.disconnected += 1;
                finished += 1;
                release = true;
            }
            Event::Unreachable(rcm::Unreachable::RepTimeout) if id != *listener => {
                r.unconfirmed += 1;
                finished += 1;
                release = true;
                if log {
                    println!(
                        "rcm ping: server: {:?} never confirmed the connection (REP timeout)",
                        id.peer_addr()
                    );
                }
            }
            Event::TimewaitExit => {}
            Event::DeviceRemoval if id == *listener => {
                // No request can come any more (the device, or the daemon, is gone).
                r.errors.push(format!(
                    "server: the listener's device was removed after {finished} connection(s)"
                ));
                break;
            }
            other => {
                if id != *listener {
                    r.errors
                        .push(format!("server: event {}: {other:?}", other.name()));
                    finished += 1;
                    release = true;
                }
            }
        }
        drop(e);
        if release {
            drop(id.begin_destroy());
        }
    }
}

/// iWARP with no message exchange: how long the server leaves the first move to the client
/// before disconnecting. Linux siw as the initiator reports a connect error when the
/// passive side's FIN follows its MPA Reply too closely (seen in the interop VM: ucmatose
/// got CONNECT_ERROR -22); with a message exchange the client has visibly processed the
/// Reply before the server ends the connection.
const IWARP_GRACE: Duration = Duration::from_millis(500);

/// How long the client waits for the server to disconnect an established connection.
const SERVER_GRACE: Duration = Duration::from_secs(10);

/// What a client connection left in `state` when the run timed out was waiting for; `None`
/// for one that finished (a UD one is done once resolved: it has nothing to disconnect).
fn unfinished(state: State, dst: SocketAddr, iwarp: bool, ud: bool) -> Option<String> {
    Some(match state {
        State::AddrQuery | State::AddrResolved => "address resolution did not finish".into(),
        State::RouteQuery | State::RouteResolved => "route resolution did not finish".into(),
        State::Connect if iwarp => {
            format!("no answer from {dst} to the connect request (is there a TCP listener?)")
        }
        State::Connect => format!(
            "no answer from {dst} to the connect request (is there an rdma_cm listener on \
             port {} and a CM on {}'s RoCEv2 UDP port?)",
            dst.port(),
            dst.ip()
        ),
        State::Established if ud => return None,
        State::Established => "established, but never disconnected".into(),
        State::Disconnect | State::Destroying | State::DeviceRemoval => return None,
        other => format!("left in state {other:?}"),
    })
}

/// Runs the client side.
fn client_loop(
    fabric: &Fabric,
    ch: &EventChannel,
    (src, dst): (IpAddr, SocketAddr),
    o: &PingOpts,
    r: &mut PingReport,
    deadline: Instant,
    log: bool,
) {
    let n = o.count.max(1);
    let mut ids = HashMap::new();
    for i in 0..n {
        let id = fabric.create_id_on(o.ps, ch);
        // From the bound device's address: through a daemon with several devices, the one
        // asked for, not the daemon's pick.
        if let Err(e) = id.resolve_addr(Some(src), dst) {
            r.errors.push(format!("client {i}: resolve_addr: {e}"));
            continue;
        }
        ids.insert(id.key(), (i, id));
    }
    let mut finished = 0usize;
    // Established connections the server has not disconnected yet. The server normally ends
    // each one; if its REP retries all died (a half-open connection IBTA allows under loss),
    // nobody would, so after a grace period the client disconnects itself (reported apart).
    let mut open: HashMap<u64, (Instant, CmId)> = HashMap::new();
    // Connections whose reply's private data a CONNECT_RESPONSE carried and was checked.
    // Without one (iWARP: the MPA Reply's data comes with ESTABLISHED), ESTABLISHED's is
    // checked, whether or not this side was told the transport: through an iWARP daemon
    // without `--transport iwarp` the reply's data went unchecked.
    let mut replied: std::collections::HashSet<u64> = std::collections::HashSet::new();
    while finished < ids.len() {
        let now = Instant::now();
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() {
            r.errors.push(format!(
                "client: timed out with {} connection(s) unfinished",
                ids.len() - finished
            ));
            let mut stuck: Vec<_> = ids.values().collect();
            stuck.sort_by_key(|(i, _)| *i);
            for (i, id) in stuck {
                if let Some(why) = unfinished(id.state(), dst, o.iwarp, ud(o.ps)) {
                    r.errors.push(format!("client {i}: {why}"));
                }
            }
            break;
        }
        open.retain(|_, (since, id)| {
            if now.duration_since(*since) > SERVER_GRACE {
                r.closed_by_client += 1;
                let _ = id.disconnect();
                false
            } else {
                true
            }
        });
        let Some(e) = ch.get_event(Some(left.min(Duration::from_secs(1)))) else {
            continue;
        };
        let id = e.id().clone();
        if matches!(e.event(), Event::Established { ud: None, .. }) {
            open.insert(id.key(), (Instant::now(), id.clone()));
        } else if matches!(e.event(), Event::Disconnected) {
            open.remove(&id.key());
        }
        let i = ids.get(&id.key()).map_or(usize::MAX, |(i, _)| *i);
        match e.event() {
            Event::AddrResolved => {
                if let Err(err) = id.resolve_route() {
                    r.errors.push(format!("client {i}: resolve_route: {err}"));
                    finished += 1;
                }
            }
            Event::RouteResolved => {
                let opts = ConnectOptions {
                    private_data: o.private_data.clone(),
                    ..ConnectOptions::default()
                };
                if let Err(err) = id.connect(&opts) {
                    r.errors.push(format!("client {i}: connect: {err}"));
                    finished += 1;
                }
            }
            Event::ConnectResponse { private_data, .. } => {
                replied.insert(id.key());
                if pd_matches(private_data, &o.private_data) {
                    r.private_data_ok += 1;
                } else {
                    r.errors
                        .push(format!("client {i}: reply private data differs"));
                }
                if let Err(err) = id.establish() {
                    r.errors.push(format!("client {i}: establish: {err}"));
                    finished += 1;
                }
            }
            Event::Established {
                private_data,
                ud: udp,
            } => {
                r.established += 1;
                if o.reject {
                    r.errors.push(format!(
                        "client {i}: established, but --reject expects the server to reject"
                    ));
                }
                if log {
                    println!(
                        "rcm ping: client {i}: established to {dst}{}",
                        udp.map(|u| format!(" (UD QPN {:#x}, Q_Key {:#x})", u.qpn, u.qkey))
                            .unwrap_or_default()
                    );
                }
                // iWARP has no CONNECT_RESPONSE: the MPA Reply's private data comes with
                // ESTABLISHED, exactly as long as sent (told the transport) or as a reply
                // checked nowhere else (through a daemon, not told it).
                let reply_ok = if o.iwarp {
                    Some(private_data == &o.private_data)
                } else if udp.is_none() && !replied.contains(&id.key()) {
                    Some(pd_matches(private_data, &o.private_data))
                } else {
                    None
                };
                match reply_ok {
                    Some(true) => r.private_data_ok += 1,
                    Some(false) => r
                        .errors
                        .push(format!("client {i}: reply private data differs")),
                    None => {}
                }
                if o.iwarp {
                    let pd = &o.private_data;
                    let who = format!("client {i}");
                    let (ping, pong) = (ping_message(pd), pong_message(pd));
                    exchange(&id, o.messages, (&ping, &pong), &who, r, log);
                }
                if ud(o.ps) {
                    if pd_matches(private_data, &o.private_data) {
                        r.private_data_ok += 1;
                    } else {
                        r.errors
                            .push(format!("client {i}: SIDR_REP private data differs"));
                    }
                    if let (Some(u), true) = (udp, o.messages > 0) {
                        let who = format!("client {i}");
                        ud_exchange(&id, (dst.ip(), *u), o, &who, r, deadline, log);
                    }
                    r.disconnected += 1;
                    finished += 1;
                }
            }
            Event::Disconnected => {
                r.disconnected += 1;
                finished += 1;
            }
            Event::TimewaitExit => {}
            Event::Rejected {
                reason,
                private_data,
            } => {
                // Anything but the server's rdma_reject (28) is no reject as asked: no
                // listener (8), a stale connection…
                let by_server = *reason == rcm_wire::cm::RejReason::ConsumerDefined;
                let why = format!("reason {} ({reason:?})", reason.raw());
                client_rejected(r, o, i, &why, by_server, private_data, log);
                finished += 1;
            }
            // A UD server's reject is a SIDR_REP with status 2, which rdma_cm reports as
            // UNREACHABLE (Linux's cma_sidr_rep_handler).
            Event::Unreachable(rcm::Unreachable::Sidr {
                status,
                private_data,
            }) if *status == rcm_wire::cm::SidrStatus::Rejected => {
                let why = format!("SIDR status {} ({status:?})", status.raw());
                client_rejected(r, o, i, &why, true, private_data, log);
                finished += 1;
            }
            Event::Unreachable(u) => {
                r.errors.push(format!("client {i}: event UNREACHABLE: {u}"));
                finished += 1;
            }
            other => {
                r.errors
                    .push(format!("client {i}: event {}: {other:?}", other.name()));
                finished += 1;
            }
        }
    }
    for (_, (_, id)) in ids {
        drop(id.begin_destroy());
    }
}

/// The most connections one run makes or serves (as `rcm bench -c`): each is an id made
/// before the first connects, and one address has ~28k ephemeral ports anyway.
pub const MAX_COUNT: usize = 1_000_000;

/// A server's listen backlog: every connection asked for, and never less than the default
/// (1,024; also for a count of 0, serving forever). A client makes its connects at once, and
/// past the backlog a request is refused (iWARP) or dropped and retried a second later
/// (RoCE).
fn backlog(o: &PingOpts) -> usize {
    o.count.max(1024)
}

/// Runs `rcm ping` as asked.
pub fn run(o: &PingOpts, log: bool) -> Result<PingReport, String> {
    if o.count == 0 && o.listen != Some(true) {
        // A client with 0 made one connection, which is not what 0 says anywhere.
        return Err(
            "--count 0 (serve forever) is for --listen; a client makes at least one \
                    connection"
                .into(),
        );
    }
    if o.count > MAX_COUNT {
        return Err(format!(
            "--count {}: at most {MAX_COUNT} connections",
            o.count
        ));
    }
    if o.iwarp {
        if ud(o.ps) {
            return Err("iWARP carries only the TCP port space (--ps tcp)".into());
        }
        // Each side sends all its messages before it reads any, and a message that finds the
        // peer's receive queue full ends the stream (a Terminate, as a Send with no receive
        // posted does): more than the queue holds failed with a message about the state.
        let queue = rcm_proto::iw::CepConfig::default().recv_queue;
        if o.messages > queue {
            return Err(format!(
                "--messages {}: over iWARP each side sends all its messages before it reads, \
                 and the peer's receive queue holds {queue}: at most {queue}",
                o.messages
            ));
        }
        if o.daemon.is_some() && o.messages > 0 {
            return Err(
                "--transport iwarp: messages are not carried through the daemon (add --no-messages)"
                    .into(),
            );
        }
    }
    // The client sends --private-data in its request and the server answers with it in its
    // accept: both must carry it. Rejects carry --reject-data (or --private-data).

    let (pd_max, pd_what, rej_max, rej_what) = match (o.iwarp, ud(o.ps)) {
        (true, _) => (
            rcm::IWARP_PRIVATE_DATA_MAX,
            "an MPA Request or Reply",
            rcm::IWARP_PRIVATE_DATA_MAX,
            "an MPA Reply",
        ),
        (false, false) => (
            rcm_wire::cma::limits::CONNECT.min(rcm_wire::cma::limits::ACCEPT),
            "a REQ (after rdma_cm's header)",
            rcm_wire::cma::limits::REJECT,
            "a REJ",
        ),
        (false, true) => (
            rcm_wire::cma::limits::CONNECT_UD.min(rcm_wire::cma::limits::ACCEPT_UD),
            "a SIDR_REP",
            rcm_wire::cma::limits::REJECT_UD,
            "a SIDR_REP",
        ),
    };
    if o.private_data.len() > pd_max {
        return Err(format!(
            "--private-data is {} bytes; {pd_what} carries at most {pd_max}",
            o.private_data.len()
        ));
    }
    if reject_pd(o).len() > rej_max {
        return Err(format!(
            "--reject-data is {} bytes; {rej_what} carries at most {rej_max}",
            reject_pd(o).len()
        ));
    }
    if !o.iwarp && ud(o.ps) && o.messages > 0 {
        if o.daemon.is_some() {
            return Err(
                "--ps udp: UD datagrams are not carried through the daemon (add --messages 0)"
                    .into(),
            );
        }
        if o.size == 0 || o.size > rcm::UD_MAX_PAYLOAD {
            return Err(format!(
                "--size {}: a UD datagram carries 1 to {} bytes",
                o.size,
                rcm::UD_MAX_PAYLOAD
            ));
        }
        // Shorter, a message loses the "ping <n> " that numbers it, and is neither matched
        // nor checked byte for byte.
        let need = format!("ping {} ", o.messages - 1).len();
        if o.size < need {
            return Err(format!(
                "--size {}: each message starts with \"ping <n> \" ({need} bytes with --messages \
                 {}), which it would cut: at least {need}",
                o.size, o.messages
            ));
        }
    }
    let cfg = FabricConfig {
        udp_port: o.udp_port,
        ..FabricConfig::default()
    };
    let (fabric, daemon_devs) = match &o.daemon {
        Some(p) => {
            let f =
                rcm_ucm::fabric_with(p, cfg).map_err(|e| format!("daemon {}: {e}", p.display()))?;
            let devs = f.device_addrs();
            if devs.is_empty() {
                return Err(format!("the daemon at {} has no devices", p.display()));
            }
            (f, Some(devs))
        }
        None => (Fabric::new(cfg), None),
    };
    // Through a daemon the devices are its own: use them, never add any.
    let add = |ip: IpAddr| -> Result<(), String> {
        match &daemon_devs {
            Some(d) if d.contains(&ip) => Ok(()),
            Some(d) => Err(format!("the daemon has no device on {ip} (it has {d:?})")),
            None if o.iwarp => fabric
                .add_iwarp_device_with(
                    ip,
                    rcm_proto::iw::CepConfig {
                        max_revision: o.mpa_version,
                        ..rcm_proto::iw::CepConfig::default()
                    },
                )
                .map(drop)
                .map_err(|e| crate::device_error(&format!("iWARP device on {ip}"), &e)),
            None => fabric
                .add_device(ip)
                .map(drop)
                .map_err(|e| crate::device_error(&format!("device on {ip}"), &e)),
        }
    };
    let first = daemon_devs.as_ref().and_then(|d| d.first().copied());
    let second = daemon_devs
        .as_ref()
        .and_then(|d| d.get(1).or(d.first()).copied());
    let deadline = Instant::now() + o.timeout;
    let mut r = PingReport {
        connections: o.count.max(usize::from(o.listen != Some(true))),
        ..PingReport::default()
    };
    let default_port = o.port;
    match o.listen {
        Some(true) => {
            let bind = o.bind.or(first).unwrap_or(IpAddr::from([127, 0, 0, 1]));
            add(bind)?;
            let ch = EventChannel::new();
            let l = fabric.create_id_on(o.ps, &ch);
            l.bind(SocketAddr::new(bind, default_port))
                .map_err(|e| format!("bind: {e}"))?;
            l.listen(backlog(o)).map_err(|e| format!("listen: {e}"))?;
            if log {
                println!("rcm ping: listening on {bind}:{default_port} ({:?})", o.ps);
            }
            r.role = "server".into();
            r.connections = o.count;
            server_loop(&ch, &l, o, &mut r, deadline, log);
        }
        Some(false) => {
            let dst = o.connect.ok_or("--connect needs an address")?;
            let bind = match (o.bind, &daemon_devs) {
                (Some(b), _) => b,
                // A daemon device of the destination's family, another than the destination
                // if there is one (as two processes on one host would use).
                (None, Some(d)) => {
                    let fits = |ip: &&IpAddr| ip.is_ipv4() == dst.is_ipv4();
                    d.iter()
                        .filter(fits)
                        .find(|ip| **ip != dst)
                        .or_else(|| d.iter().find(fits))
                        .copied()
                        .ok_or_else(|| {
                            format!("the daemon has no device of {dst}'s family (it has {d:?})")
                        })?
                }
                (None, None) => crate::default_source(dst)?,
            };
            add(bind)?;
            let ch = EventChannel::new();
            r.role = "client".into();
            client_loop(
                &fabric,
                &ch,
                (bind, SocketAddr::new(dst, default_port)),
                o,
                &mut r,
                deadline,
                log,
            );
        }
        None => {
            // `--bind` puts both ends on that one device (the client connects to its own
            // address, as two clients of a one-address daemon do: `::1` has no second).
            let s = o.bind.or(first).unwrap_or(IpAddr::from([127, 0, 0, 1]));
            let c = o.bind.or(second).unwrap_or(IpAddr::from([127, 0, 0, 2]));
            add(s)?;
            if c != s {
                add(c)?;
            }
            let sch = EventChannel::new();
            let l = fabric.create_id_on(o.ps, &sch);
            l.bind(SocketAddr::new(s, default_port))
                .map_err(|e| format!("bind: {e}"))?;
            l.listen(backlog(o)).map_err(|e| format!("listen: {e}"))?;
            let so = PingOpts {
                count: o.count.max(1),
                ..o.clone()
            };
            let server = std::thread::spawn(move || {
                let mut sr = PingReport::default();
                server_loop(&sch, &l, &so, &mut sr, deadline, false);
                sr
            });
            let ch = EventChannel::new();
            r.role = "both".into();
            client_loop(
                &fabric,
                &ch,
                (c, SocketAddr::new(s, default_port)),
                o,
                &mut r,
                deadline,
                log,
            );
            let sr = server
                .join()
                .map_err(|_| "server thread panicked".to_string())?;
            r.errors.extend(sr.errors);
            r.private_data_ok += sr.private_data_ok;
            r.messages_ok += sr.messages_ok;
            r.messages_unverified += sr.messages_unverified;
            r.messages_expected += sr.messages_expected;
        }
    }
    fabric.shutdown();
    Ok(r)
}
