use super::*;
use proptest::prelude::*;

const LEN: usize = 3 * 4096;
const AT: RingAt = RingAt {
    ctl: 0,
    data: 4096,
    cap: 4096,
};

/// A ring's two ends, each on its own mapping of one memfd (as in two processes).
fn ends() -> (Producer, Consumer, Arc<Region>) {
    let (a, fd) = Region::create("rcm-shm-test", LEN).expect("create");
    let b = Region::open(&fd, LEN).expect("open");
    let a = Arc::new(a);
    let p = Producer::new(a.clone(), AT).expect("producer");
    let c = Consumer::new(Arc::new(b), AT).expect("consumer");
    (p, c, a)
}

#[test]
fn frames_cross_in_order_around_the_wrap() {
    let (mut p, mut c, _) = ends();
    let mut out = Vec::new();
    // Sizes that do not divide the ring, so frames and their lengths straddle its end.
    for i in 0..5000usize {
        let f: Vec<u8> = (0..(i * 7) % 301).map(|k| (k + i) as u8).collect();
        assert_eq!(p.push(&f), Ok(Some(false)), "frame {i}");
        assert!(c.pop(&mut out, 4096).expect("pop"), "frame {i} missing");
        assert_eq!(out, f, "frame {i}");
    }
    assert!(!c.pop(&mut out, 4096).expect("pop"));
}

#[test]
fn bytes_stored_eight_at_a_time_read_back_from_any_offset_and_touch_nothing_else() {
    let (a, fd) = Region::create("rcm-shm-test", 4096).expect("create");
    let b = Region::open(&fd, 4096).expect("open");
    let mut out = Vec::new();
    for off in 0..17 {
        for n in 0..41 {
            let around = (off + n + 8).min(4096);
            for x in a.bytes(0, around) {
                x.store(0xEE, Ordering::Relaxed);
            }
            let src: Vec<u8> = (0..n).map(|k| (k * 31 + off) as u8).collect();
            a.store(off, &src);
            out.clear();
            out.resize(n, 0);
            b.load(off, &mut out);
            assert_eq!(out, src, "{n} bytes at {off}");
            let mut all = vec![0u8; around];
            b.load(0, &mut all);
            assert!(
                all[..off].iter().chain(&all[off + n..]).all(|&x| x == 0xEE),
                "{n} bytes at {off} wrote outside their range"
            );
        }
    }
    assert_eq!(split_at_words(5, 2), (2, 0, 0));
    assert_eq!(split_at_words(5, 20), (3, 2, 1));
    assert_eq!(split_at_words(16, 7), (0, 0, 7));
}

#[test]
fn a_full_ring_takes_nothing_until_the_consumer_reads() {
    let (mut p, mut c, _) = ends();
    let f = [9u8; 1000];
    let mut n = 0;
    while p.push(&f).expect("push").is_some() {
        n += 1;
    }
    assert_eq!(n, 4, "4 frames of 1,004 bytes fit in 4,096");
    let mut out = Vec::new();
    assert!(c.pop(&mut out, 4096).expect("pop"));
    assert_eq!(p.push(&f), Ok(Some(false)), "room again after a read");
    assert_eq!(
        p.push(&[0u8; 4093]),
        Err(Corrupt("a frame longer than the ring"))
    );
}

#[test]
fn the_producer_reads_the_consumers_index_again_only_when_the_one_last_read_runs_out() {
    let (mut p, _c, shared) = ends();
    assert_eq!(p.push(&[1u8; 100]), Ok(Some(false)));
    // A consumer index out of range is not seen while the one read at the first push
    // leaves room (2,056 + 112 bytes fit in 4,096)...
    shared
        .u32_at(AT.ctl + 64)
        .store(0xDEAD_0000, Ordering::SeqCst);
    assert_eq!(p.push(&[2u8; 2048]), Ok(Some(false)));
    // ...and is when it does not.
    assert_eq!(
        p.push(&[3u8; 2048]),
        Err(Corrupt("the consumer's index is past the producer's"))
    );
}

#[test]
fn the_consumer_finds_a_frame_by_its_header_and_reads_the_producers_index_when_none_is_there() {
    let (mut p, mut c, shared) = ends();
    let mut out = Vec::new();
    // A new ring's zeroed memory is no frame.
    assert!(!c.has_data());
    assert_eq!(c.pop(&mut out, 4096), Ok(false));
    assert_eq!(p.push(&[1u8; 100]), Ok(Some(false)));
    assert_eq!(p.push(&[2u8; 30]), Ok(Some(false)));
    // The frames are taken by their headers, whatever the producer's index says...
    shared.u32_at(AT.ctl).store(0, Ordering::SeqCst);
    assert!(c.has_data());
    assert!(c.pop(&mut out, 4096).expect("pop"));
    assert_eq!(out, [1u8; 100]);
    assert!(c.pop(&mut out, 4096).expect("pop"));
    assert_eq!(out, [2u8; 30]);
    // ...which is read on an empty look: behind what was taken, it is nothing yet (a
    // producer publishes its index after the frame's header), and the consumer may sleep
    // (the producer wakes it after it publishes)...
    assert_eq!(c.pop(&mut out, 4096), Ok(false));
    assert!(
        !c.has_data(),
        "an index behind what was taken said a frame waits"
    );
    assert!(
        c.prepare_sleep(),
        "an index behind what was taken kept the consumer awake"
    );
    c.awake();
    // ...past it with no header there, or out of range, a broken ring.
    shared.u32_at(AT.ctl).store(8 + 112 + 40, Ordering::SeqCst);
    assert_eq!(
        c.pop(&mut out, 4096),
        Err(Corrupt("a frame published without its header"))
    );
    shared.u32_at(AT.ctl).store(0x7FFF_0000, Ordering::SeqCst);
    assert!(!c.prepare_sleep(), "asleep on a broken ring");
    assert_eq!(
        c.pop(&mut out, 4096),
        Err(Corrupt("the producer's index is out of range"))
    );
    // A header tagged with another index (a frame of the ring's last lap, where this end's
    // index now points) is no frame.
    let (mut p, mut c, _) = ends();
    // 128 bytes each (a header word and 120 bytes): 32 a lap, the 41st's header where the
    // 9th's was.
    for _ in 0..40 {
        assert_eq!(p.push(&[5u8; 120]), Ok(Some(false)));
        assert!(c.pop(&mut out, 4096).expect("pop"));
    }
    assert!(!c.has_data(), "last lap's header taken for a frame");
    assert_eq!(c.pop(&mut out, 4096), Ok(false));
}

#[test]
fn a_frame_over_the_consumers_limit_is_refused() {
    let (mut p, mut c, _) = ends();
    p.push(&[1u8; 100]).expect("push");
    let mut out = Vec::new();
    assert_eq!(c.pop(&mut out, 99), Err(Corrupt("a frame over the limit")));
}

#[test]
fn a_sleeping_consumer_is_reported_and_sees_what_came_before_it_slept() {
    let (mut p, mut c, _) = ends();
    assert!(c.prepare_sleep(), "nothing came: it may sleep");
    assert_eq!(p.push(b"x"), Ok(Some(true)), "the producer sees it asleep");
    c.awake();
    assert_eq!(p.push(b"y"), Ok(Some(false)));
    // Frames waiting: it must not sleep.
    assert!(!c.prepare_sleep());
    assert_eq!(p.push(b"z"), Ok(Some(false)), "the flag was taken back");
    let mut out = Vec::new();
    for want in [b"x", b"y", b"z"] {
        assert!(c.pop(&mut out, 10).expect("pop"));
        assert_eq!(out, want);
    }
}

#[test]
fn only_a_sealed_region_of_the_agreed_size_is_opened() {
    let (_, fd) = Region::create("rcm-shm-test", LEN).expect("create");
    assert!(Region::open(&fd, LEN + 4096).is_err(), "another size");
    let raw = rustix::fs::memfd_create("rcm-shm-unsealed", rustix::fs::MemfdFlags::CLOEXEC)
        .expect("memfd");
    rustix::fs::ftruncate(&raw, LEN as u64).expect("size");
    let e = Region::open(&raw, LEN).expect_err("an unsealed memfd");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(
        Region::create("rcm-shm-test", 100).is_err(),
        "not whole pages"
    );
    assert!(
        Producer::new(
            Arc::new(Region::create("rcm-shm-test", 4096).expect("create").0),
            AT
        )
        .is_err(),
        "a ring past the region's end"
    );
}

#[test]
fn two_threads_pass_a_hundred_thousand_frames_in_order() {
    const N: u32 = 100_000;
    let (mut p, mut c, _) = ends();
    let t = std::thread::spawn(move || {
        for i in 0..N {
            let f = i.to_le_bytes().repeat(1 + (i % 13) as usize);
            while p.push(&f).expect("push").is_none() {
                std::thread::yield_now();
            }
        }
    });
    let mut out = Vec::new();
    for i in 0..N {
        while !c.pop(&mut out, 4096).expect("pop") {
            std::thread::yield_now();
        }
        assert_eq!(
            out,
            i.to_le_bytes().repeat(1 + (i % 13) as usize),
            "frame {i}"
        );
    }
    t.join().expect("producer");
}

proptest! {
    /// Whatever the peer writes into the shared control words and data, the ends answer
    /// with frames or errors: no panic, no access outside the region.
    #[test]
    fn garbage_from_the_peer_gives_errors_not_panics(
        words in proptest::collection::vec((0usize..3, any::<u32>()), 0..8),
        data in proptest::collection::vec((0usize..4096, any::<u8>()), 0..64),
        frames in proptest::collection::vec(0usize..600, 0..8),
    ) {
        let (mut p, mut c, shared) = ends();
        for len in &frames {
            let _ = p.push(&vec![7u8; *len]);
        }
        for (w, v) in words {
            shared.u32_at(AT.ctl + w * 64).store(v, Ordering::SeqCst);
        }
        for (at, v) in data {
            shared.bytes(AT.data + at, 1)[0].store(v, Ordering::SeqCst);
        }
        let mut out = Vec::new();
        for _ in 0..16 {
            match c.pop(&mut out, 512) {
                Ok(true) => prop_assert!(out.len() <= 512),
                Ok(false) | Err(_) => break,
            }
        }
        for len in frames {
            if p.push(&vec![1u8; len]).is_err() {
                break;
            }
        }
    }
}

/// Words of an earlier lap are no headers: a frame's payload (private data a remote peer
/// chose, in the daemon's events ring) may hold a word shaped like the header a later lap
/// tags that slot with. A consumer that caught up looks at the slot after the last frame;
/// the producer clears it before publishing the frame, so the consumer finds nothing there
/// instead of a frame nobody pushed.
#[test]
fn a_word_left_from_an_earlier_lap_is_never_taken_for_a_header() {
    let (mut p, mut c, _) = ends();
    let cap = AT.cap;
    // One frame filling the ring, each payload word the header of its slot one lap on.
    let mut forged = Vec::new();
    for slot in (8..cap).step_by(8) {
        forged.extend_from_slice(&header(slot + cap, 16).to_ne_bytes());
    }
    assert_eq!(p.push(&forged), Ok(Some(false)));
    let mut out = Vec::new();
    assert!(c.pop(&mut out, 4096).expect("pop"));
    // Next lap: one small frame, taken; then nothing, whatever the slot after it held.
    assert_eq!(p.push(b"8 bytes!"), Ok(Some(false)));
    assert!(c.pop(&mut out, 4096).expect("pop"));
    assert_eq!(out, b"8 bytes!");
    assert_eq!(
        c.pop(&mut out, 4096),
        Ok(false),
        "a frame nobody pushed: {out:?}"
    );
    assert!(!c.has_data());
    // And the ring goes on as before.
    assert_eq!(p.push(b"after"), Ok(Some(false)));
    assert!(c.pop(&mut out, 4096).expect("pop"));
    assert_eq!(out, b"after");
}

/// The same, in the steady state: the consumer's index the producer knows is old there (it
/// reads it only when short of room), and the slot after each frame is cleared all the same.
/// Every frame's payload is forged for every slot's next lap; each pop that finds nothing
/// must be an empty ring, never a frame nobody pushed.
#[test]
fn no_earlier_laps_word_is_taken_for_a_header_as_the_ring_goes_round() {
    let (mut p, mut c, _) = ends();
    let cap = AT.cap;
    let mut out = Vec::new();
    let mut tail = 0u32;
    for i in 0..3000u32 {
        let words = 1 + (i * 7) % 40;
        let mut f = Vec::new();
        for k in 0..words {
            // The header this payload word's slot gets one and two laps on.
            let at = tail + 8 + 8 * k;
            let lap = if k % 2 == 0 { cap } else { 2 * cap };
            f.extend_from_slice(&header(at.wrapping_add(lap), 8).to_ne_bytes());
        }
        assert_eq!(p.push(&f), Ok(Some(false)), "frame {i}");
        tail = tail.wrapping_add(Producer::footprint(f.len()) as u32);
        assert!(c.pop(&mut out, 4096).expect("pop"), "frame {i} missing");
        assert_eq!(out, f, "frame {i}");
        assert_eq!(c.pop(&mut out, 4096), Ok(false), "after frame {i}: {out:?}");
    }
}
