//! Helpers shared by the test files that run the `rcm` binary.
#![allow(dead_code)] // each test file uses its own subset

use rcm::PortSpace;
use rcm_wire::cm::{CmMad, CmMessage, Dreq, Req, ReqPath, TransportType};
use rcm_wire::cma::{self, CmaHdr};
use rcm_wire::Gid;
use std::net::Ipv4Addr;
use std::process::Command;

/// Runs `rcm` with `args`; returns (exit code, stdout, stderr).
pub fn rcm(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args(args)
        .output()
        .expect("run rcm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A REQ as rdma_cm sends it (TCP port space, cma_hdr for `src` → `dst`).
pub fn req_mad(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    port: u16,
    comm_id: u32,
    guid: u64,
    qpn: u32,
) -> [u8; 256] {
    let pd = CmaHdr {
        src_port: 40000,
        src: src.into(),
        dst: dst.into(),
    }
    .with_user_data(b"rcmf forged", cma::limits::CONNECT)
    .expect("cma_hdr");
    let req = Req {
        local_comm_id: comm_id,
        service_id: cma::service_id(PortSpace::Tcp, port),
        local_ca_guid: guid,
        local_qpn: qpn & 0xFF_FFFF,
        responder_resources: 1,
        initiator_depth: 1,
        remote_cm_response_timeout: 20,
        transport_type: TransportType::Rc,
        starting_psn: qpn & 0xFF_FFFF,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        primary_path: ReqPath {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: Gid::from_ip(src.into()),
            remote_gid: Gid::from_ip(dst.into()),
            hop_limit: 64,
            local_ack_timeout: 19,
            ..ReqPath::default()
        },
        private_data: pd,
        ..Req::default()
    };
    CmMad::send(u64::from(comm_id), CmMessage::Req(req))
        .emit()
        .expect("REQ encodes")
}

/// A DREQ for the connection `local` ↔ `remote` whose peer QP is `remote_qpn`.
pub fn dreq_mad(local: u32, remote: u32, remote_qpn: u32) -> [u8; 256] {
    let dreq = Dreq {
        local_comm_id: local,
        remote_comm_id: remote,
        remote_qpn: remote_qpn & 0xFF_FFFF,
        ..Dreq::default()
    };
    CmMad::send(u64::from(local), CmMessage::Dreq(dreq))
        .emit()
        .expect("DREQ encodes")
}

/// A daemon a test started: killed (by its PID) if the test fails before stopping it.
pub struct Started {
    child: std::process::Child,
    /// Its standard error after the "serving" line, read on as it comes.
    log: std::sync::Arc<std::sync::Mutex<String>>,
    drain: Option<std::thread::JoinHandle<()>>,
}

impl Started {
    /// Spawns `cmd` (an `rcm daemon`, perhaps under a wrapper such as valgrind) and waits
    /// up to `limit` for its "serving" line on standard error, which is then read on so
    /// the daemon never blocks on a full pipe. Panics if it exits first or takes longer.
    pub fn serving(mut cmd: Command, limit: std::time::Duration) -> Started {
        use std::io::{BufRead, BufReader};
        let mut c = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn rcm daemon");
        let err = c.stderr.take().expect("stderr");
        let mut lines = BufReader::new(err).lines();
        let t0 = std::time::Instant::now();
        let mut before = String::new();
        loop {
            if t0.elapsed() >= limit {
                let _ = c.kill();
                panic!("daemon did not start within {limit:?}:\n{before}");
            }
            match lines.next() {
                Some(Ok(l)) if l.contains("SIGTERM or Ctrl-C to stop") => break,
                Some(Ok(l)) => {
                    before.push_str(&l);
                    before.push('\n');
                }
                _ => {
                    let _ = c.kill();
                    panic!("daemon exited before serving: {:?}\n{before}", c.wait())
                }
            }
        }
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let kept = log.clone();
        let drain = std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                if let Ok(mut k) = kept.lock() {
                    k.push_str(&l);
                    k.push('\n');
                }
            }
        });
        Started {
            child: c,
            log,
            drain: Some(drain),
        }
    }

    /// What it wrote to standard error after it began serving, once it has exited.
    pub fn log(&mut self) -> String {
        if let Some(h) = self.drain.take() {
            let _ = h.join();
        }
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl std::ops::Deref for Started {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.child
    }
}

impl std::ops::DerefMut for Started {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.child
    }
}

/// The CPUs this test process may run on, in order.
pub fn allowed_cpus() -> Vec<usize> {
    let set = rustix::thread::sched_getaffinity(None).expect("affinity");
    (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect()
}

/// A CPU-bound process (a shell's busy loop, which never yields) on one CPU, ended however
/// the test ends.
pub struct Hog(std::process::Child);

impl Hog {
    /// Starts one on `cpu` (`taskset`, util-linux).
    pub fn on_cpu(cpu: usize) -> Hog {
        Hog(Command::new("taskset")
            .args(["-c", &cpu.to_string(), "sh", "-c", "while :; do :; done"])
            .spawn()
            .expect("taskset (util-linux)"))
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
