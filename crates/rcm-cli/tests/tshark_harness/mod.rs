//! The tshark harness of the two Wireshark cross-check suites (`tshark.rs`: RoCEv2 and the
//! CM; `tshark_iwarp.rs`: MPA, DDP and RDMAP over TCP): finding tshark, running it, reading
//! its fields and packet trees, and the pcap files they are fed.
// Each suite uses its own part of it.
#![allow(dead_code)]

use rcm_cli::netbuild::PcapOut;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The installed tshark.
pub struct Tshark {
    pub bin: PathBuf,
    /// (major, minor) of the installed Wireshark.
    pub version: (u32, u32),
    pub version_line: String,
    /// The heuristic sub-dissectors turned off (those of the suite this tshark knows).
    disable: Vec<String>,
}

impl Tshark {
    /// The §6.3 flow-label / packet-rate bugs and the MPA v2 blindness are those of 4.0; later
    /// versions may have fixed them, so there a test accepts either reading.
    pub fn is_4_0(&self) -> bool {
        self.version == (4, 0)
    }

    pub fn base_command(&self, file: &Path) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("-n").arg("-r").arg(file);
        for h in &self.disable {
            cmd.arg("--disable-heuristic").arg(h);
        }
        cmd
    }

    pub fn run(cmd: &mut Command) -> String {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "tshark failed ({}): {cmd:?}\nstderr:\n{stderr}",
            out.status
        );
        let bad: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("tshark:") && !l.contains("Running as user"))
            .collect();
        assert!(
            bad.is_empty(),
            "tshark complained: {bad:?}\ncommand: {cmd:?}"
        );
        String::from_utf8(out.stdout).expect("tshark output is UTF-8")
    }

    /// `tshark -T fields`, `frame.number` first, one [`Row`] per frame; several occurrences of
    /// a field come joined by ','. `checksums` turns on IP/TCP checksum validation.
    pub fn fields(&self, file: &Path, fields: &[&str], checksums: bool) -> Vec<Row> {
        let mut cmd = self.base_command(file);
        if checksums {
            cmd.args([
                "-o",
                "tcp.check_checksum:TRUE",
                "-o",
                "ip.check_checksum:TRUE",
            ]);
        }
        cmd.args(["-T", "fields", "-E", "header=n", "-E", "separator=/t"]);
        cmd.args(["-E", "occurrence=a", "-E", "aggregator=,", "-E", "quote=n"]);
        cmd.args(["-e", "frame.number"]);
        for f in fields {
            cmd.args(["-e", f]);
        }
        let text = Self::run(&mut cmd);
        text.lines()
            .map(|line| {
                let mut cols = line.split('\t');
                let frame = cols
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("tshark line without a frame number: {line:?}"));
                let mut vals = HashMap::new();
                for (f, v) in fields.iter().zip(cols) {
                    vals.insert((*f).to_owned(), v.to_owned());
                }
                Row { frame, vals }
            })
            .collect()
    }

    /// `tshark -V`: the full packet tree as text.
    pub fn verbose(&self, file: &Path) -> String {
        let mut cmd = self.base_command(file);
        cmd.arg("-V");
        Self::run(&mut cmd)
    }

    /// `tshark -V`, and split per frame (frame number → its text).
    pub fn verbose_frames(&self, file: &Path) -> (String, HashMap<usize, String>) {
        let text = self.verbose(file);
        let mut frames: HashMap<usize, String> = HashMap::new();
        let mut cur = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("Frame ") {
                if let Some(n) = rest.split(':').next().and_then(|s| s.parse().ok()) {
                    cur = Some(n);
                }
            }
            if let Some(n) = cur {
                let s = frames.entry(n).or_default();
                s.push_str(line);
                s.push('\n');
            }
        }
        (text, frames)
    }

    /// The expert-info summary (`-z expert`).
    pub fn expert_summary(&self, file: &Path) -> String {
        let mut cmd = self.base_command(file);
        cmd.args(["-q", "-z", "expert"]);
        Self::run(&mut cmd)
    }
}

/// `RCM_REQUIRE_TSHARK=1`: a test that cannot check against tshark fails instead of skipping.
pub fn required() -> bool {
    std::env::var("RCM_REQUIRE_TSHARK").is_ok_and(|v| v == "1")
}

/// Says loudly, on the process's stderr (which the test harness's output capture cannot
/// hide), that `test` checked nothing against Wireshark, and why.
pub fn loud_skip(test: &str, why: &str) {
    let bar = "!".repeat(100);
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "\n{bar}\n!!! SKIPPED {test}: {why}\n!!! The encoder is NOT being checked against \
         Wireshark here. Install tshark (Debian/Ubuntu: apt-get install tshark), or set \
         RCM_REQUIRE_TSHARK=1 to make this a failure (CI does).\n{bar}"
    );
}

/// tshark at `$TSHARK` or on the PATH, with those of `heuristics` (short names of heuristic
/// sub-dissectors that could claim the suite's payloads) that it knows turned off: tshark
/// refuses names it does not know.
fn find(heuristics: &[&str]) -> Option<Tshark> {
    let bin = std::env::var_os("TSHARK").map_or_else(|| PathBuf::from("tshark"), PathBuf::from);
    let out = match Command::new(&bin).arg("-v").output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("tshark ({}) is there but cannot be run: {e}", bin.display()),
    };
    assert!(
        out.status.success(),
        "`{} -v` failed: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let version_line = text.lines().next().unwrap_or_default().to_owned();
    // "TShark (Wireshark) 4.0.17 (Git v4.0.17 packaged as 4.0.17-0+deb12u3)."
    let version = version_line
        .split_whitespace()
        .find_map(|w| {
            let mut it = w.split('.');
            let major = it.next()?.parse().ok()?;
            let minor = it.next()?.parse().ok()?;
            Some((major, minor))
        })
        .unwrap_or((0, 0));
    let mut t = Tshark {
        bin,
        version,
        version_line,
        disable: heuristics.iter().map(|s| (*s).to_owned()).collect(),
    };
    // Ask once which names this tshark refuses ("No such protocol X, can't disable").
    let empty = TempFile::new("probe", "pcap");
    let pcap = PcapOut::new(Vec::new())
        .and_then(PcapOut::into_inner)
        .expect("empty pcap");
    std::fs::write(empty.path(), pcap).expect("write probe pcap");
    let out = t
        .base_command(empty.path())
        .output()
        .expect("run tshark probe");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refused: Vec<String> = stderr
        .lines()
        .filter_map(|l| {
            l.split("No such protocol ")
                .nth(1)?
                .split(',')
                .next()
                .map(str::to_owned)
        })
        .collect();
    t.disable.retain(|h| !refused.contains(h));
    Some(t)
}

/// The installed tshark (found at the first call, with `heuristics` turned off, see `find`),
/// or `None` after a loud skip; a failure instead with `RCM_REQUIRE_TSHARK=1`.
pub fn tshark(test: &str, heuristics: &[&str]) -> Option<&'static Tshark> {
    static T: OnceLock<Option<Tshark>> = OnceLock::new();
    let t = T.get_or_init(|| find(heuristics)).as_ref();
    if t.is_none() {
        assert!(
            !required(),
            "{test}: tshark is not installed (or not on PATH / $TSHARK), and RCM_REQUIRE_TSHARK=1 \
             says it must be: install tshark (apt-get install tshark)"
        );
        loud_skip(test, "tshark NOT FOUND (not on PATH, nor at $TSHARK)");
    }
    t
}

/// One frame of `tshark -T fields` output.
pub struct Row {
    pub frame: usize,
    vals: HashMap<String, String>,
}

impl Row {
    pub fn get(&self, field: &str) -> &str {
        self.vals
            .get(field)
            .unwrap_or_else(|| panic!("test bug: field {field} was not asked of tshark"))
    }

    /// Every occurrence of a numeric field.
    pub fn nums(&self, field: &str) -> Vec<u64> {
        let v = self.get(field);
        if v.is_empty() {
            return Vec::new();
        }
        v.split(',')
            .map(|s| {
                parse_num(s)
                    .unwrap_or_else(|| panic!("frame {}: {field}: not a number: {s:?}", self.frame))
            })
            .collect()
    }

    /// The single value of a numeric field, if present.
    pub fn num(&self, field: &str) -> Option<u64> {
        self.nums(field).first().copied()
    }

    /// Every occurrence of a bytes field, as bytes.
    pub fn bytes_each(&self, field: &str) -> Vec<Vec<u8>> {
        let v = self.get(field);
        if v.is_empty() {
            return Vec::new();
        }
        v.split(',').map(unhex).collect()
    }
}

/// A file under the temp directory, removed on drop (kept with `RCM_TSHARK_KEEP`).
pub struct TempFile(PathBuf);

impl TempFile {
    pub fn new(tag: &str, ext: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        TempFile(
            std::env::temp_dir().join(format!("rcm-tshark-{}-{tag}-{n}.{ext}", std::process::id())),
        )
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if std::env::var_os("RCM_TSHARK_KEEP").is_none() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// Writes Ethernet frames into a pcap under the temp directory.
pub fn write_pcap(tag: &str, frames: &[(Duration, Vec<u8>)]) -> TempFile {
    let mut out = PcapOut::new(Vec::new()).expect("pcap header");
    for (ts, f) in frames {
        out.write_frame(*ts, f).expect("pcap frame");
    }
    let bytes = out.into_inner().expect("pcap bytes");
    let file = TempFile::new(tag, "pcap");
    std::fs::write(file.path(), bytes)
        .unwrap_or_else(|e| panic!("writing {}: {e}", file.path().display()));
    file
}

/// Reads a tshark integer: "0x…" is hex, "True"/"False" are 1/0, anything else decimal.
pub fn parse_num(s: &str) -> Option<u64> {
    let s = s.trim();
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else if s.eq_ignore_ascii_case("true") {
        Some(1)
    } else if s.eq_ignore_ascii_case("false") {
        Some(0)
    } else {
        s.parse().ok()
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// The bytes of a tshark bytes field (hex digits, separators ignored).
pub fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(char::is_ascii_hexdigit).collect();
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}
