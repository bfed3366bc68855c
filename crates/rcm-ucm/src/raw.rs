//! A bare protocol session, for tests, fuzzing and debugging: send any command or bytes,
//! read any message. Applications use [`crate::fabric`] instead.

use crate::proto::{self, decode_message, Command, Header, Message, ProtoError};
use std::collections::VecDeque;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A raw session: no reader thread, nothing interpreted.
pub struct RawSession {
    stream: UnixStream,
    seq: u32,
    /// Messages read while waiting for a reply with another sequence number.
    stash: VecDeque<(u32, Message)>,
}

impl RawSession {
    /// Connects (no Hello is sent).
    pub fn connect(path: impl AsRef<Path>) -> std::io::Result<Self> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RawSession {
            stream,
            seq: 0,
            stash: VecDeque::new(),
        })
    }

    /// Connects and opens the session; returns it with its token.
    pub fn open(path: impl AsRef<Path>) -> std::io::Result<(Self, u64)> {
        let mut s = Self::connect(path)?;
        match s.call(&Command::Hello {
            min: proto::VERSION,
            max: proto::VERSION,
        })? {
            Message::HelloOk { token, .. } => Ok((s, token)),
            m => Err(std::io::Error::other(format!("hello answered with {m:?}"))),
        }
    }

    /// Sets how long a read waits.
    pub fn set_timeout(&self, d: Duration) -> std::io::Result<()> {
        self.stream.set_read_timeout(Some(d))
    }

    /// Sends a command; returns its sequence number.
    pub fn send(&mut self, cmd: &Command) -> std::io::Result<u32> {
        self.seq = self.seq.wrapping_add(1).max(1);
        crate::spin::send_all(&self.stream, &cmd.encode(self.seq))?;
        Ok(self.seq)
    }

    /// Sends `MAP_CHANNEL` on this (attached) connection and reads its answer, with the
    /// shared memory the daemon sent if it mapped the channel (`None` with its refusal).
    /// From then on the daemon reads this channel's commands from the memory's ring (see
    /// [`crate::shmchan`]), and a byte written here is a doorbell.
    pub fn map_channel(&mut self) -> std::io::Result<(Message, Option<rcm_shm::Region>)> {
        self.map(&Command::MapChannel, crate::shmchan::REGION_BYTES)
    }

    /// Sends `MAP_EVENTS` on this session's connection and reads its answer, with the
    /// shared memory the daemon sent if it mapped the session's events (`None` with its
    /// refusal). From then on everything the daemon writes for the session is in the
    /// memory's ring ([`crate::shmchan::EVENTS`]), and this socket brings only doorbells.
    pub fn map_events(&mut self) -> std::io::Result<(Message, Option<rcm_shm::Region>)> {
        self.map(&Command::MapEvents, crate::shmchan::EVENTS_REGION_BYTES)
    }

    fn map(
        &mut self,
        cmd: &Command,
        len: usize,
    ) -> std::io::Result<(Message, Option<rcm_shm::Region>)> {
        if !self.stash.is_empty() {
            return Err(std::io::Error::other("messages are stashed"));
        }
        let seq = self.send(cmd)?;
        let (h, body, fd) = crate::shmchan::recv_with_fd(&self.stream, 1 << 20)?;
        if h.seq != seq {
            return Err(std::io::Error::other("an answer to another command"));
        }
        let m = decode_message(h.kind, &body).map_err(|e| invalid(&e))?;
        let region = match fd {
            Some(fd) => Some(rcm_shm::Region::open(&fd, len)?),
            None => None,
        };
        Ok((m, region))
    }

    /// Whether the daemon closed this connection (its end read, within the read timeout).
    pub fn closed_by_daemon(&mut self) -> bool {
        let mut b = [0u8; 256];
        loop {
            match self.stream.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }

    /// Sends raw bytes.
    pub fn send_bytes(&mut self, b: &[u8]) -> std::io::Result<()> {
        crate::spin::send_all(&self.stream, b)
    }

    /// Reads the next message (stashed ones first) with its sequence number.
    pub fn recv(&mut self) -> std::io::Result<(u32, Message)> {
        if let Some(m) = self.stash.pop_front() {
            return Ok(m);
        }
        self.read_one()
    }

    fn read_one(&mut self) -> std::io::Result<(u32, Message)> {
        let mut hb = [0u8; 12];
        self.stream.read_exact(&mut hb)?;
        let h = Header::parse(&hb).map_err(|e| invalid(&e))?;
        // A header's length is not trusted with an allocation (the client library's cap).
        if h.body_len() > 1 << 20 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "frame from the daemon is too long",
            ));
        }
        let mut body = vec![0u8; h.body_len()];
        self.stream.read_exact(&mut body)?;
        let m = decode_message(h.kind, &body).map_err(|e| invalid(&e))?;
        Ok((h.seq, m))
    }

    /// Sends a command and waits for its reply; events that come first are kept for
    /// [`RawSession::recv`].
    pub fn call(&mut self, cmd: &Command) -> std::io::Result<Message> {
        let seq = self.send(cmd)?;
        self.wait_reply(seq)
    }

    /// Waits for the reply to `seq`.
    pub fn wait_reply(&mut self, seq: u32) -> std::io::Result<Message> {
        if let Some(i) = self
            .stash
            .iter()
            .position(|(s, m)| *s == seq && !matches!(m, Message::Event { .. }))
        {
            if let Some((_, m)) = self.stash.remove(i) {
                return Ok(m);
            }
        }
        loop {
            let (s, m) = self.read_one()?;
            if s == seq && !matches!(m, Message::Event { .. }) {
                return Ok(m);
            }
            self.stash.push_back((s, m));
        }
    }

    /// Waits for the next event.
    pub fn next_event(&mut self) -> std::io::Result<Message> {
        if let Some(i) = self
            .stash
            .iter()
            .position(|(_, m)| matches!(m, Message::Event { .. }))
        {
            if let Some((_, m)) = self.stash.remove(i) {
                return Ok(m);
            }
        }
        loop {
            let (s, m) = self.read_one()?;
            if matches!(m, Message::Event { .. }) {
                return Ok(m);
            }
            self.stash.push_back((s, m));
        }
    }

    /// The underlying stream.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }
}

fn invalid(e: &ProtoError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}
