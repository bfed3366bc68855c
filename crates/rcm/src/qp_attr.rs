//! What `init_qp_attr` hands an application to move its QP with: the attributes, which of
//! them apply (the mask), and the access flags, as Linux's `rdma_init_qp_attr` fills in
//! `struct ib_qp_attr` and its `qp_attr_mask`.

use rcm_wire::Gid;

/// QP states, for `init_qp_attr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Initialised.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
}

impl QpState {
    fn rank(self) -> u8 {
        match self {
            QpState::Init => 0,
            QpState::Rtr => 1,
            QpState::Rts => 2,
        }
    }
}

/// Which fields of a [`QpAttr`] to apply: verbs' `enum ibv_qp_attr_mask`, bit for bit, so
/// `mask.bits()` can be passed to `ibv_modify_qp` as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct QpAttrMask(u32);

impl QpAttrMask {
    /// `qp_state`.
    pub const STATE: QpAttrMask = QpAttrMask(1 << 0);
    /// `qp_access_flags`.
    pub const ACCESS_FLAGS: QpAttrMask = QpAttrMask(1 << 3);
    /// `pkey_index`.
    pub const PKEY_INDEX: QpAttrMask = QpAttrMask(1 << 4);
    /// `port_num`.
    pub const PORT: QpAttrMask = QpAttrMask(1 << 5);
    /// `qkey`.
    pub const QKEY: QpAttrMask = QpAttrMask(1 << 6);
    /// The address vector: `sgid`, `dgid`, `flow_label`, `hop_limit`, `traffic_class` (and
    /// `port_num` as its port).
    pub const AV: QpAttrMask = QpAttrMask(1 << 7);
    /// `path_mtu`.
    pub const PATH_MTU: QpAttrMask = QpAttrMask(1 << 8);
    /// `timeout`.
    pub const TIMEOUT: QpAttrMask = QpAttrMask(1 << 9);
    /// `retry_cnt`.
    pub const RETRY_CNT: QpAttrMask = QpAttrMask(1 << 10);
    /// `rnr_retry`.
    pub const RNR_RETRY: QpAttrMask = QpAttrMask(1 << 11);
    /// `rq_psn`.
    pub const RQ_PSN: QpAttrMask = QpAttrMask(1 << 12);
    /// `max_rd_atomic`.
    pub const MAX_QP_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 13);
    /// `min_rnr_timer`.
    pub const MIN_RNR_TIMER: QpAttrMask = QpAttrMask(1 << 15);
    /// `sq_psn`.
    pub const SQ_PSN: QpAttrMask = QpAttrMask(1 << 16);
    /// `max_dest_rd_atomic`.
    pub const MAX_DEST_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 17);
    /// `dest_qp_num`.
    pub const DEST_QPN: QpAttrMask = QpAttrMask(1 << 20);

    /// No field.
    pub const fn empty() -> QpAttrMask {
        QpAttrMask(0)
    }
    /// The verbs bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// The mask of these verbs bits; bits rcm never sets are kept as they are.
    pub const fn from_bits(bits: u32) -> QpAttrMask {
        QpAttrMask(bits)
    }
    /// Whether every bit of `other` is set here.
    pub const fn contains(self, other: QpAttrMask) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for QpAttrMask {
    type Output = QpAttrMask;
    fn bitor(self, o: QpAttrMask) -> QpAttrMask {
        QpAttrMask(self.0 | o.0)
    }
}

/// What a remote peer may do to a QP's memory: verbs' `enum ibv_access_flags`, bit for bit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// RDMA Write into it.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(1 << 1);
    /// RDMA Read from it.
    pub const REMOTE_READ: AccessFlags = AccessFlags(1 << 2);
    /// Atomic operations on it.
    pub const REMOTE_ATOMIC: AccessFlags = AccessFlags(1 << 3);

    /// None.
    pub const fn empty() -> AccessFlags {
        AccessFlags(0)
    }
    /// The verbs bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// The flags of these verbs bits; bits rcm never sets are kept as they are.
    pub const fn from_bits(bits: u32) -> AccessFlags {
        AccessFlags(bits)
    }
    /// Whether every flag of `other` is set here.
    pub const fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, o: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | o.0)
    }
}

/// The attributes to move a QP to a state with (what `rdma_init_qp_attr` fills in): apply
/// the fields `attr_mask` names, and only those (a field outside it may hold anything).
///
/// The masks are Linux's (cm.c `cm_init_qp_*_attr`, iwcm.c `iwcm_init_qp_*_attr`, cma.c
/// `rdma_init_qp_attr`):
///
/// | QP | INIT | RTR | RTS |
/// |----|------|-----|-----|
/// | RC, RoCE | STATE, ACCESS_FLAGS, PKEY_INDEX, PORT | STATE, AV, PATH_MTU, DEST_QPN, RQ_PSN, MAX_DEST_RD_ATOMIC, MIN_RNR_TIMER | STATE, SQ_PSN, TIMEOUT, RETRY_CNT, RNR_RETRY, MAX_QP_RD_ATOMIC |
/// | UD (`PortSpace::Udp`, `Ipoib`) | STATE, PKEY_INDEX, PORT, QKEY | the same | the same |
/// | iWARP | STATE, ACCESS_FLAGS, PORT | STATE, ACCESS_FLAGS, PORT | PORT (iw_cm moves the QP to RTS itself) |
///
/// The access flags: remote write, and remote read and atomics too when the connection
/// has responder resources, on RoCE; remote write and read on iWARP; none for an id that
/// has not connected yet (no CM connection: rdma_cm's "default values", which librdmacm
/// updates by asking for INIT again at RTR). Once the connection is going or gone (DREQ,
/// REJ, timeout, close: the id's state `Disconnect`) a connected QP has no attributes in
/// any state: `init_qp_attr` says `InvalidState`, as Linux says EINVAL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QpAttr {
    /// Target state.
    pub qp_state: Option<QpState>,
    /// The fields to apply.
    pub attr_mask: QpAttrMask,
    /// Access flags (INIT; iWARP RTR). RTS attributes carry the connection's too, outside
    /// their mask, so that [`QpAttr::for_state`] can give INIT's.
    pub qp_access_flags: AccessFlags,
    /// P_Key index (always 0: the default partition on RoCE).
    pub pkey_index: u16,
    /// Port number (1).
    pub port_num: u8,
    /// Q_Key (UD only).
    pub qkey: u32,
    /// Path MTU enum (RTR).
    pub path_mtu: u8,
    /// Remote QPN (RTR).
    pub dest_qp_num: u32,
    /// Receive PSN: the peer's starting PSN (RTR).
    pub rq_psn: u32,
    /// Max incoming RDMA reads (RTR).
    pub max_dest_rd_atomic: u8,
    /// Minimum RNR NAK timer (RTR).
    pub min_rnr_timer: u8,
    /// Source GID.
    pub sgid: Gid,
    /// Destination GID (RTR).
    pub dgid: Gid,
    /// Flow label (RTR).
    pub flow_label: u32,
    /// Hop limit (RTR).
    pub hop_limit: u8,
    /// Traffic class (RTR).
    pub traffic_class: u8,
    /// Send PSN: ours (RTS).
    pub sq_psn: u32,
    /// Local ACK timeout (RTS).
    pub timeout: u8,
    /// Retry count (RTS).
    pub retry_cnt: u8,
    /// RNR retry (RTS).
    pub rnr_retry: u8,
    /// Max outstanding RDMA reads (RTS).
    pub max_rd_atomic: u8,
}

/// Which CM the attributes came from, told by their mask (see [`QpAttr`]'s table): only
/// UD's has QKEY; only RoCE RC's has PKEY_INDEX (INIT), DEST_QPN (RTR) or SQ_PSN (RTS).
enum Kind {
    Ud,
    RoceRc,
    Iwarp,
}

impl QpAttr {
    fn kind(&self) -> Kind {
        let m = self.attr_mask;
        if m.contains(QpAttrMask::QKEY) {
            Kind::Ud
        } else if m.contains(QpAttrMask::PKEY_INDEX)
            || m.contains(QpAttrMask::DEST_QPN)
            || m.contains(QpAttrMask::SQ_PSN)
        {
            Kind::RoceRc
        } else {
            Kind::Iwarp
        }
    }

    /// The INIT mask of an RC QP on RoCE.
    pub(crate) const RC_INIT: QpAttrMask = QpAttrMask(
        QpAttrMask::STATE.0
            | QpAttrMask::ACCESS_FLAGS.0
            | QpAttrMask::PKEY_INDEX.0
            | QpAttrMask::PORT.0,
    );
    /// The RTR mask of an RC QP on RoCE.
    pub(crate) const RC_RTR: QpAttrMask = QpAttrMask(
        QpAttrMask::STATE.0
            | QpAttrMask::AV.0
            | QpAttrMask::PATH_MTU.0
            | QpAttrMask::DEST_QPN.0
            | QpAttrMask::RQ_PSN.0
            | QpAttrMask::MAX_DEST_RD_ATOMIC.0
            | QpAttrMask::MIN_RNR_TIMER.0,
    );
    /// The RTS mask of an RC QP on RoCE.
    pub(crate) const RC_RTS: QpAttrMask = QpAttrMask(
        QpAttrMask::STATE.0
            | QpAttrMask::SQ_PSN.0
            | QpAttrMask::TIMEOUT.0
            | QpAttrMask::RETRY_CNT.0
            | QpAttrMask::RNR_RETRY.0
            | QpAttrMask::MAX_QP_RD_ATOMIC.0,
    );
    /// The mask of a UD QP, in every state.
    pub(crate) const UD: QpAttrMask = QpAttrMask(
        QpAttrMask::STATE.0 | QpAttrMask::PKEY_INDEX.0 | QpAttrMask::PORT.0 | QpAttrMask::QKEY.0,
    );
    /// The INIT and RTR mask of an iWARP QP (and every state's before it connects).
    pub(crate) const IW_INIT: QpAttrMask =
        QpAttrMask(QpAttrMask::STATE.0 | QpAttrMask::ACCESS_FLAGS.0 | QpAttrMask::PORT.0);
    /// The RTS mask of a connected iWARP QP.
    pub(crate) const IW_RTS: QpAttrMask = QpAttrMask::PORT;

    /// The attributes for `state` taken from the attributes for a later state: what
    /// [`CmId::init_qp_attr`](crate::CmId::init_qp_attr) returns for `state` on the id these
    /// (RTS) attributes came from, as long as the connection has not moved on
    /// (`init_qp_attr` itself builds the RTS attributes and cuts them down with this). A
    /// provider's client answers `init_qp_attr` with it from attributes the daemon sent
    /// along with an event, without a round trip. `None` when `state` is later than these
    /// attributes'.
    pub fn for_state(&self, state: QpState) -> Option<QpAttr> {
        let own = self.qp_state?;
        if state.rank() > own.rank() {
            return None;
        }
        if state == own {
            return Some(self.clone());
        }
        let mut a = match self.kind() {
            Kind::Ud => {
                return Some(QpAttr {
                    qp_state: Some(state),
                    ..self.clone()
                })
            }
            // INIT carries the port, partition and access flags only.
            Kind::RoceRc if state == QpState::Init => QpAttr {
                attr_mask: QpAttr::RC_INIT,
                qp_access_flags: self.qp_access_flags,
                pkey_index: self.pkey_index,
                port_num: self.port_num,
                ..QpAttr::default()
            },
            Kind::RoceRc => QpAttr {
                attr_mask: QpAttr::RC_RTR,
                // The send side's fields belong to RTS.
                sq_psn: 0,
                timeout: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                max_rd_atomic: 0,
                ..self.clone()
            },
            Kind::Iwarp => QpAttr {
                attr_mask: QpAttr::IW_INIT,
                qp_access_flags: self.qp_access_flags,
                port_num: self.port_num,
                ..QpAttr::default()
            },
        };
        a.qp_state = Some(state);
        Some(a)
    }
}
