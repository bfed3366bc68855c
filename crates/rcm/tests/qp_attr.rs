//! `init_qp_attr` gives, with the attributes, the mask of those to apply and the access
//! flags Linux gives (cm.c `cm_init_qp_*_attr`, iwcm.c `iwcm_init_qp_*_attr`, cma.c
//! `rdma_init_qp_attr`), before the connection, while it is set up and once it is up, on
//! RoCE RC, UD and iWARP; and `QpAttr::for_state` gives from RTS what each earlier state
//! gives.
#![cfg(not(loom))]

mod common;

use common::{addr, ip, T};
use rcm::{
    AcceptOptions, AccessFlags, CmId, ConnectOptions, Error, Event, EventChannel, Fabric,
    PortSpace, QpAttr, QpAttrMask, QpState, State,
};

use QpState::{Init, Rtr, Rts};

fn rc_init() -> QpAttrMask {
    QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT
}

fn rc_rtr() -> QpAttrMask {
    QpAttrMask::STATE
        | QpAttrMask::AV
        | QpAttrMask::PATH_MTU
        | QpAttrMask::DEST_QPN
        | QpAttrMask::RQ_PSN
        | QpAttrMask::MAX_DEST_RD_ATOMIC
        | QpAttrMask::MIN_RNR_TIMER
}

fn rc_rts() -> QpAttrMask {
    QpAttrMask::STATE
        | QpAttrMask::SQ_PSN
        | QpAttrMask::TIMEOUT
        | QpAttrMask::RETRY_CNT
        | QpAttrMask::RNR_RETRY
        | QpAttrMask::MAX_QP_RD_ATOMIC
}

fn iw_init() -> QpAttrMask {
    QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS | QpAttrMask::PORT
}

fn all_rc() -> AccessFlags {
    AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC
}

fn attr(id: &CmId, s: QpState) -> QpAttr {
    id.init_qp_attr(s)
        .unwrap_or_else(|e| panic!("{s:?} attributes: {e}"))
}

/// Mask and access flags of `id`'s attributes for `s`.
fn mf(id: &CmId, s: QpState) -> (QpAttrMask, AccessFlags) {
    let a = attr(id, s);
    assert_eq!(a.qp_state, Some(s));
    (a.attr_mask, a.qp_access_flags)
}

/// What RTS gives, cut down, is what each state gives.
fn assert_for_state_agrees(id: &CmId) {
    let rts = attr(id, Rts);
    for s in [Init, Rtr, Rts] {
        assert_eq!(rts.for_state(s), Some(attr(id, s)), "{s:?}");
    }
}

/// What the test saw of one connection: the client's INIT before it connected and after,
/// the child's INIT at its connect request.
struct Seen {
    client: CmId,
    child: CmId,
    client_init_before: (QpAttrMask, AccessFlags),
    client_rtr_before: Result<QpAttr, Error>,
    client_init_connecting: (QpAttrMask, AccessFlags),
    child_init_at_request: (QpAttrMask, AccessFlags),
}

/// One connection on `f` from 127.0.0.2 to a listener on 127.0.0.1:`port`, the client
/// connecting with `co` and the child accepting with `ao`, all in channel mode.
fn connect(
    f: &Fabric,
    ps: PortSpace,
    port: u16,
    co: &ConnectOptions,
    ao: &AcceptOptions,
) -> (Seen, CmId) {
    let ch = EventChannel::new();
    let l = f.create_id_on(ps, &ch);
    l.bind(addr(1, port)).expect("bind");
    l.listen(8).expect("listen");
    let c = f.create_id_on(ps, &ch);
    c.resolve_addr(Some(ip(2)), addr(1, port)).expect("resolve");
    let (mut before, mut rtr_before, mut connecting, mut at_request) = (None, None, None, None);
    let mut child: Option<CmId> = None;
    let ud = ps == PortSpace::Udp;
    loop {
        let client_up = c.state() == State::Established;
        let child_up = child
            .as_ref()
            .is_some_and(|k| k.state() == State::Established);
        if client_up && child_up {
            break;
        }
        let mut e = ch.get_event(Some(T)).expect("event");
        let id = e.id().clone();
        match e.take().expect("event") {
            Event::AddrResolved => id.resolve_route().expect("route"),
            Event::RouteResolved => {
                before = Some(mf(&id, Init));
                rtr_before = Some(id.init_qp_attr(Rtr));
                id.connect(co).expect("connect");
                if !ud {
                    connecting = Some(mf(&id, Init));
                }
            }
            Event::ConnectRequest { .. } => {
                at_request = Some(mf(&id, Init));
                id.accept(ao).expect("accept");
                child = Some(id);
            }
            Event::ConnectResponse { .. } => id.establish().expect("establish"),
            Event::Established { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let seen = Seen {
        client: c,
        child: child.expect("child"),
        client_init_before: before.expect("route resolved"),
        client_rtr_before: rtr_before.expect("route resolved"),
        client_init_connecting: connecting.unwrap_or(before.expect("route resolved")),
        child_init_at_request: at_request.expect("request"),
    };
    (seen, l)
}

#[test]
fn rc_attributes_come_with_linuxs_masks_and_access_flags() {
    let f = common::fabric(25060);
    // The child grants no responder resources and asks for none: the client's, taken
    // from the REP, become none too.
    let ao = AcceptOptions {
        responder_resources: 0,
        initiator_depth: 0,
        ..AcceptOptions::default()
    };
    let (s, l) = connect(&f, PortSpace::Tcp, 7890, &ConnectOptions::default(), &ao);
    // Before connect there is no CM connection: "default values", no access.
    assert_eq!(s.client_init_before, (rc_init(), AccessFlags::empty()));
    assert_eq!(
        s.client_rtr_before,
        Err(Error::InvalidState(State::RouteResolved))
    );
    // The REQ offered one responder resource: remote read and atomics too.
    assert_eq!(s.client_init_connecting, (rc_init(), all_rc()));
    // The child's, from the REQ's initiator depth (1).
    assert_eq!(s.child_init_at_request, (rc_init(), all_rc()));
    // Up: each side's from what it grants, as negotiated.
    for id in [&s.client, &s.child] {
        assert_eq!(mf(id, Init), (rc_init(), AccessFlags::REMOTE_WRITE));
        assert_eq!(mf(id, Rtr).0, rc_rtr());
        assert_eq!(mf(id, Rts).0, rc_rts());
        assert_eq!(attr(id, Rtr).max_dest_rd_atomic, 0);
        assert_for_state_agrees(id);
    }
    // Disconnecting: the CM has no attributes for the QP any more, INIT's neither.
    s.client.disconnect().expect("disconnect");
    for st in [Init, Rtr, Rts] {
        assert_eq!(
            s.client.init_qp_attr(st),
            Err(Error::InvalidState(State::Disconnect)),
            "{st:?}"
        );
    }
    for id in [s.client, s.child, l] {
        id.destroy().expect("destroy");
    }
    f.shutdown();
}

#[test]
fn rc_access_flags_follow_the_responder_resources_granted() {
    let f = common::fabric(25061);
    // The client grants none; the child grants two.
    let co = ConnectOptions {
        responder_resources: 0,
        ..ConnectOptions::default()
    };
    let ao = AcceptOptions {
        responder_resources: 2,
        ..AcceptOptions::default()
    };
    let (s, l) = connect(&f, PortSpace::Tcp, 7890, &co, &ao);
    assert_eq!(
        s.client_init_connecting,
        (rc_init(), AccessFlags::REMOTE_WRITE)
    );
    // The REQ's initiator depth is 1: the child has a responder resource at its request.
    assert_eq!(s.child_init_at_request, (rc_init(), all_rc()));
    // The REP's initiator depth (1) is the client's responder resources from then on.
    assert_eq!(mf(&s.client, Init), (rc_init(), all_rc()));
    assert_eq!(mf(&s.child, Init), (rc_init(), all_rc()));
    assert_eq!(attr(&s.child, Rtr).max_dest_rd_atomic, 2);
    for id in [&s.client, &s.child] {
        assert_for_state_agrees(id);
    }
    for id in [s.client, s.child, l] {
        id.destroy().expect("destroy");
    }
    f.shutdown();
}

#[test]
fn ud_attributes_are_inits_in_every_state() {
    let f = common::fabric(25062);
    let (s, l) = connect(
        &f,
        PortSpace::Udp,
        7891,
        &ConnectOptions::default(),
        &AcceptOptions::default(),
    );
    let ud = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY;
    assert_eq!(s.client_init_before, (ud, AccessFlags::empty()));
    assert_eq!(s.child_init_at_request, (ud, AccessFlags::empty()));
    for id in [&s.client, &s.child] {
        for st in [Init, Rtr, Rts] {
            assert_eq!(mf(id, st), (ud, AccessFlags::empty()), "{st:?}");
            assert_eq!(attr(id, st).qkey, rcm_wire::cma::RDMA_UDP_QKEY);
        }
        assert_for_state_agrees(id);
    }
    for id in [s.client, s.child, l] {
        id.destroy().expect("destroy");
    }
    f.shutdown();
}

#[test]
fn iwarp_attributes_are_the_access_flags_and_the_port() {
    let f = Fabric::new(common::config(25063));
    for l in [1, 2] {
        f.add_iwarp_device(ip(l)).expect("iWARP device");
    }
    let (s, l) = connect(
        &f,
        PortSpace::Tcp,
        27995,
        &ConnectOptions::default(),
        &AcceptOptions::default(),
    );
    let rw = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    // No iw_cm id before connect: no access, for any state.
    assert_eq!(s.client_init_before, (iw_init(), AccessFlags::empty()));
    assert_eq!(
        s.client_rtr_before
            .as_ref()
            .map(|a| (a.attr_mask, a.qp_access_flags)),
        Ok((iw_init(), AccessFlags::empty()))
    );
    assert_eq!(s.client_init_connecting, (iw_init(), rw));
    assert_eq!(s.child_init_at_request, (iw_init(), rw));
    for id in [&s.client, &s.child] {
        assert_eq!(mf(id, Init), (iw_init(), rw));
        assert_eq!(mf(id, Rtr), (iw_init(), rw));
        // iw_cm moves the QP to RTS itself: only the port.
        assert_eq!(attr(id, Rts).attr_mask, QpAttrMask::PORT);
        assert_for_state_agrees(id);
    }
    for id in [s.client, s.child, l] {
        id.destroy().expect("destroy");
    }
    f.shutdown();
}
