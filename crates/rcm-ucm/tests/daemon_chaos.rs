//! rcm's raw-peer chaos (`crates/rcm/tests/raw_peer`) through the daemon: a raw CM peer
//! sends CM messages in any order at ids a client holds in the daemon, while the client
//! answers what it sees and destroys them. On top of what the chaos checks at the client
//! (every destroy completes, no event after it, no second DISCONNECTED, no id left), the
//! daemon must hold nothing afterwards: no id of the session, no id, port binding or engine
//! endpoint in its fabric.

mod common;
#[path = "../../rcm/tests/raw_peer/mod.rs"]
mod raw_peer;

use common::{config, wait_until};
use rcm_ucm::Daemon;

#[test]
fn a_peer_sending_cm_messages_in_any_order_through_the_daemon() {
    let d = Daemon::start(config("chaos", 47808, &[1])).expect("daemon");
    let peer = raw_peer::RawPeer::new(47808);
    let f = rcm_ucm::fabric(d.socket()).expect("session");
    raw_peer::chaos(&f, &peer, 0x9E37_79B9_7F4A_7C15, 120);
    wait_until(
        || {
            let df = d.fabric();
            d.held_ids() == 0
                && df.live_ids() == 0
                && df.bound_ports() == 0
                && df.engine_ceps() == 0
        },
        || {
            let df = d.fabric();
            format!(
                "the daemon still holds: {} session ids, {} ids, {} ports, {} engine endpoints",
                d.held_ids(),
                df.live_ids(),
                df.bound_ports(),
                df.engine_ceps()
            )
        },
    );
    f.shutdown();
    d.shutdown();
}
