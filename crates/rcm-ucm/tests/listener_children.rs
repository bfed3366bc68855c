//! A listener destroyed while connect requests for it are unread takes its children with
//! it, and everything queued for them (docs/ucm-protocol.md §8).

mod common;

use common::*;
use rcm::{DestroyOutcome, EventChannel};
use rcm_ucm::proto::{Command, Message};
use rcm_ucm::Daemon;
use std::time::Duration;

/// §8: "`DESTROY_ID` removes the handle at once, discards the id's queued events, and, for a
/// listener, also discards the connect requests still queued for it and destroys their child
/// ids ... no event of it is queued after the removal." A child whose connect request is
/// still unread may already have a later event queued behind the request (here: its peer
/// gave up, so the child got the REJ). Destroying the listener removes that event too (it
/// stayed, and the client was handed an event for a handle it never held).
#[test]
fn destroying_a_listener_discards_its_unread_childrens_later_events() {
    let d = Daemon::start(config_patient("lchild", 48601, &[1])).expect("daemon");
    let (mut a, _) = raw(&d);
    let lh = raw_listener(&mut a, sa(1, 7901), 16);
    let peer = rcm_ucm::fabric(d.socket()).expect("peer");
    let ch = EventChannel::new();
    let c = dial(&peer, &ch, sa(1, 7901), b"x");
    // No credit: the connect request waits in A's queue, its child already in A's table.
    wait_stats(&mut a, |s| s.queued_events == 1, "the connect request");
    // The peer gives up: its REJ reaches the child, whose event queues behind the request.
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    wait_stats(
        &mut a,
        |s| s.queued_events == 2,
        "the child's event behind its request",
    );
    ok(&mut a, &Command::DestroyId(lh));
    let st = stats(&mut a);
    // Nothing of the listener or its child may be delivered now.
    a.send(&Command::GetEvent(16)).expect("send");
    a.set_timeout(Duration::from_millis(300)).expect("timeout");
    let mut delivered = Vec::new();
    while let Ok(m) = a.next_event() {
        if let Message::Event { handle, event, .. } = m {
            let name = format!("{event:?}");
            let name = name.split([' ', '{', '(']).next().unwrap_or("").to_string();
            delivered.push((handle, name));
        }
    }
    assert!(
        delivered.is_empty() && st.ids == 0 && st.queued_events == 0,
        "after destroying listener {lh}: ids {} queued_events {}; then delivered (handle, event) {delivered:?}",
        st.ids,
        st.queued_events
    );
    drop(a);
    wait_ids(&d, 0, 0);
    peer.shutdown();
}
