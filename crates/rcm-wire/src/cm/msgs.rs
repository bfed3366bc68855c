//! The IB CM messages, IBTA Vol 1 chapter 12 (tables 106–120), field by field.
//!
//! Offsets are relative to the MAD data (after the 24-byte MAD header), as in
//! wire-formats.md §3 and Linux `ibta_vol1_c12.h`. Private data is not length-prefixed on the
//! wire: a parsed message holds the whole area (zero-padded); an emitted one may hold less
//! and is zero-filled.

use super::layout::{code_enum, layout};

code_enum! {
    /// Which message an MRA acknowledges or a REJ rejects (2 bits).
    pub enum MsgCode: u8 {
        /// The REQ.
        Req = 0,
        /// The REP.
        Rep = 1,
        /// Another message (LAP for MRA; "no message" for REJ).
        Other = 2,
    }
}

code_enum! {
    /// Transport service type in a REQ (2 bits).
    pub enum TransportType: u8 {
        /// Reliable connection.
        Rc = 0,
        /// Unreliable connection.
        Uc = 1,
        /// Reliable datagram.
        Rd = 2,
        /// Extended (see the Extended Transport Type field; XRC).
        Extended = 3,
    }
}

code_enum! {
    /// REJ reason codes (IBTA table 109; Linux `enum ib_cm_rej_reason`). Vendor and future
    /// values are kept as `Unknown`.
    pub enum RejReason: u16 {
        /// No QP available.
        NoQp = 1,
        /// No EEC available.
        NoEec = 2,
        /// No resources available.
        NoResources = 3,
        /// Timeout (Linux puts its CA GUID in the ARI).
        Timeout = 4,
        /// Unsupported request.
        UnsupportedReq = 5,
        /// Invalid communication ID.
        InvalidCommId = 6,
        /// Invalid communication instance.
        InvalidCommInstance = 7,
        /// Invalid service ID: no listener.
        InvalidServiceId = 8,
        /// Invalid transport service type.
        InvalidTransportType = 9,
        /// Stale connection.
        StaleConn = 10,
        /// RDC does not exist.
        RdcNotExist = 11,
        /// Invalid primary GID.
        InvalidGid = 12,
        /// Invalid primary LID.
        InvalidLid = 13,
        /// Invalid primary SL.
        InvalidSl = 14,
        /// Invalid primary traffic class.
        InvalidTrafficClass = 15,
        /// Invalid primary hop limit.
        InvalidHopLimit = 16,
        /// Invalid primary packet rate.
        InvalidPacketRate = 17,
        /// Invalid alternate GID.
        InvalidAltGid = 18,
        /// Invalid alternate LID.
        InvalidAltLid = 19,
        /// Invalid alternate SL.
        InvalidAltSl = 20,
        /// Invalid alternate traffic class.
        InvalidAltTrafficClass = 21,
        /// Invalid alternate hop limit.
        InvalidAltHopLimit = 22,
        /// Invalid alternate packet rate.
        InvalidAltPacketRate = 23,
        /// Port and CM redirection.
        PortCmRedirect = 24,
        /// Port redirection not supported.
        PortRedirect = 25,
        /// Invalid path MTU.
        InvalidMtu = 26,
        /// Insufficient responder resources.
        InsufficientRespResources = 27,
        /// Consumer-defined reject (rdma_reject).
        ConsumerDefined = 28,
        /// Invalid RNR NAK retry count.
        InvalidRnrRetry = 29,
        /// Duplicate local communication ID.
        DuplicateLocalId = 30,
        /// Invalid class version.
        InvalidClassVersion = 31,
        /// Invalid primary flow label.
        InvalidFlowLabel = 32,
        /// Invalid alternate flow label.
        InvalidAltFlowLabel = 33,
        /// Vendor option (ECE) not supported.
        VendorOptionNotSupported = 35,
    }
}

code_enum! {
    /// SIDR_REP status (IBTA table 121).
    pub enum SidrStatus: u8 {
        /// Success: QPN and Q_Key are valid.
        Success = 0,
        /// Service ID not supported.
        UnsupportedServiceId = 1,
        /// Rejected by the service provider.
        Rejected = 2,
        /// No QP available.
        NoQp = 3,
        /// Redirect: ClassPortInfo in the additional information.
        Redirect = 4,
        /// Unsupported SIDR version.
        UnsupportedVersion = 5,
    }
}

code_enum! {
    /// APR AP status (IBTA table 117).
    pub enum ApStatus: u8 {
        /// Alternate path loaded.
        Loaded = 0,
        /// Invalid communication ID.
        InvalidCommId = 1,
        /// Alternate path not supported.
        Unsupported = 2,
        /// Rejected.
        Rejected = 3,
        /// Redirect.
        Redirect = 4,
        /// The path is already current.
        IsCurrent = 5,
        /// Invalid QPN/EECN.
        InvalidQpnEecn = 6,
        /// Invalid LID.
        InvalidLid = 7,
        /// Invalid GID.
        InvalidGid = 8,
        /// Invalid flow label.
        InvalidFlowLabel = 9,
        /// Invalid traffic class.
        InvalidTclass = 10,
        /// Invalid hop limit.
        InvalidHopLimit = 11,
        /// Invalid packet rate.
        InvalidPacketRate = 12,
        /// Invalid SL.
        InvalidSl = 13,
    }
}

layout! {
    /// One path of a REQ (primary at data offset 52, alternate at 96); 44 bytes.
    pub struct ReqPath ("REQ path", 44) {
        /// Local port LID (0xFFFF, permissive, on routed RoCEv2).
        local_lid: u16 = (0, 0, 16),
        /// Remote port LID.
        remote_lid: u16 = (2, 0, 16),
        /// Flow label (20 bits).
        flow_label: u32 = (36, 0, 20),
        /// Reserved (6 bits) after the flow label.
        reserved0: u8 = (38, 4, 6),
        /// Packet rate (6 bits, IB_RATE_*).
        packet_rate: u8 = (39, 2, 6),
        /// Traffic class.
        traffic_class: u8 = (40, 0, 8),
        /// Hop limit.
        hop_limit: u8 = (41, 0, 8),
        /// Service level (4 bits).
        sl: u8 = (42, 0, 4),
        /// Subnet local.
        subnet_local: bool = (42, 4, 1),
        /// Reserved (3 bits).
        reserved1: u8 = (42, 5, 3),
        /// Local ACK timeout (5 bits).
        local_ack_timeout: u8 = (43, 0, 5),
        /// SAP supported (alternate path only; reserved in the primary).
        sap_supported: bool = (43, 5, 1),
        /// Reserved (2 bits).
        reserved2: u8 = (43, 6, 2),
    }
    gids {
        /// Local port GID.
        local_gid @ 4,
        /// Remote port GID.
        remote_gid @ 20,
    }
}

layout! {
    /// REQ: ConnectRequest (attribute 0x0010, IBTA table 106).
    pub struct Req ("REQ", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Reserved byte before the vendor ID.
        reserved0: u8 = (4, 0, 8),
        /// ECE vendor ID (24 bits; reserved before Linux 5.9).
        vendor_id: u32 = (5, 0, 24),
        /// Service ID.
        service_id: u64 = (8, 0, 64),
        /// Local CA GUID.
        local_ca_guid: u64 = (16, 0, 64),
        /// Reserved.
        reserved1: u32 = (24, 0, 32),
        /// Local Q_Key (RD only).
        local_qkey: u32 = (28, 0, 32),
        /// Local QPN (24 bits).
        local_qpn: u32 = (32, 0, 24),
        /// Responder resources.
        responder_resources: u8 = (35, 0, 8),
        /// Local EECN (24 bits).
        local_eecn: u32 = (36, 0, 24),
        /// Initiator depth.
        initiator_depth: u8 = (39, 0, 8),
        /// Remote EECN (24 bits).
        remote_eecn: u32 = (40, 0, 24),
        /// Remote CM response timeout (5 bits).
        remote_cm_response_timeout: u8 = (43, 0, 5),
        /// Transport service type (2 bits).
        transport_type: TransportType = (43, 5, 2),
        /// End-to-end flow control.
        end_to_end_flow_control: bool = (43, 7, 1),
        /// Starting PSN (24 bits).
        starting_psn: u32 = (44, 0, 24),
        /// Local CM response timeout (5 bits).
        local_cm_response_timeout: u8 = (47, 0, 5),
        /// Retry count (3 bits).
        retry_count: u8 = (47, 5, 3),
        /// Partition key.
        pkey: u16 = (48, 0, 16),
        /// Path packet payload MTU (4 bits: 1 = 256 … 5 = 4096).
        path_mtu: u8 = (50, 0, 4),
        /// RDC exists.
        rdc_exists: bool = (50, 4, 1),
        /// RNR retry count (3 bits).
        rnr_retry_count: u8 = (50, 5, 3),
        /// Max CM retries (4 bits).
        max_cm_retries: u8 = (51, 0, 4),
        /// SRQ.
        srq: bool = (51, 4, 1),
        /// Extended transport type (3 bits; 1 = XRC).
        extended_transport_type: u8 = (51, 5, 3),
    }
    blobs {
        /// Private data (92 bytes; rdma_cm puts its 36-byte header first).
        private_data @ 140, 92;
    }
    nested {
        /// Primary path.
        primary_path: ReqPath = 52,
        /// Alternate path (all zero when absent).
        alternate_path: ReqPath = 96,
    }
}

layout! {
    /// MRA: MsgRcptAck (attribute 0x0011, table 107): "I need more time".
    pub struct Mra ("MRA", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID.
        remote_comm_id: u32 = (4, 0, 32),
        /// The message acknowledged (2 bits).
        message_mraed: MsgCode = (8, 0, 2),
        /// Reserved (6 bits).
        reserved0: u8 = (8, 2, 6),
        /// Service timeout (5 bits): extra time as 4.096 µs × 2^t.
        service_timeout: u8 = (9, 0, 5),
        /// Reserved (3 bits).
        reserved1: u8 = (9, 5, 3),
    }
    blobs {
        /// Private data (222 bytes).
        private_data @ 10, 222;
    }
}

layout! {
    /// REJ: ConnectReject (attribute 0x0012, table 108).
    pub struct Rej ("REJ", 232) {
        /// Local communication ID (0 when no local ID exists yet).
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID (the rejected message's local ID).
        remote_comm_id: u32 = (4, 0, 32),
        /// The message rejected (2 bits).
        message_rejected: MsgCode = (8, 0, 2),
        /// Reserved (6 bits).
        reserved0: u8 = (8, 2, 6),
        /// Length of the meaningful ARI bytes (7 bits, 0..=72).
        reject_info_length: u8 = (9, 0, 7),
        /// Reserved (1 bit).
        reserved1: u8 = (9, 7, 1),
        /// Reason.
        reason: RejReason = (10, 0, 16),
    }
    blobs {
        /// Additional rejection information (72 bytes; `reject_info_length` of them meaningful).
        ari @ 12, 72;
        /// Private data (148 bytes).
        private_data @ 84, 148;
    }
}

layout! {
    /// REP: ConnectReply (attribute 0x0013, table 110).
    pub struct Rep ("REP", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID.
        remote_comm_id: u32 = (4, 0, 32),
        /// Local Q_Key.
        local_qkey: u32 = (8, 0, 32),
        /// Local QPN (24 bits).
        local_qpn: u32 = (12, 0, 24),
        /// ECE vendor ID bits 23..16 (reserved before Linux 5.9).
        vendor_id_h: u8 = (15, 0, 8),
        /// Local EE context number (24 bits).
        local_eecn: u32 = (16, 0, 24),
        /// ECE vendor ID bits 15..8.
        vendor_id_m: u8 = (19, 0, 8),
        /// Starting PSN (24 bits).
        starting_psn: u32 = (20, 0, 24),
        /// ECE vendor ID bits 7..0.
        vendor_id_l: u8 = (23, 0, 8),
        /// Responder resources.
        responder_resources: u8 = (24, 0, 8),
        /// Initiator depth.
        initiator_depth: u8 = (25, 0, 8),
        /// Target ACK delay (5 bits).
        target_ack_delay: u8 = (26, 0, 5),
        /// Failover accepted (2 bits: 0 accepted, 1 unsupported, 2 rejected).
        failover_accepted: u8 = (26, 5, 2),
        /// End-to-end flow control.
        end_to_end_flow_control: bool = (26, 7, 1),
        /// RNR retry count (3 bits).
        rnr_retry_count: u8 = (27, 0, 3),
        /// SRQ.
        srq: bool = (27, 3, 1),
        /// Reserved (4 bits).
        reserved0: u8 = (27, 4, 4),
        /// Local CA GUID (4-byte aligned, not 8).
        local_ca_guid: u64 = (28, 0, 64),
    }
    blobs {
        /// Private data (196 bytes, no rdma_cm header).
        private_data @ 36, 196;
    }
}

layout! {
    /// RTU: ReadyToUse (attribute 0x0014, table 111).
    pub struct Rtu ("RTU", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID.
        remote_comm_id: u32 = (4, 0, 32),
    }
    blobs {
        /// Private data (224 bytes).
        private_data @ 8, 224;
    }
}

layout! {
    /// DREQ: DisconnectRequest (attribute 0x0015, table 112).
    pub struct Dreq ("DREQ", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID.
        remote_comm_id: u32 = (4, 0, 32),
        /// The peer's QPN (or EECN), 24 bits.
        remote_qpn: u32 = (8, 0, 24),
        /// Reserved.
        reserved0: u8 = (11, 0, 8),
    }
    blobs {
        /// Private data (220 bytes).
        private_data @ 12, 220;
    }
}

layout! {
    /// DREP: DisconnectReply (attribute 0x0016, table 113).
    pub struct Drep ("DREP", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID.
        remote_comm_id: u32 = (4, 0, 32),
    }
    blobs {
        /// Private data (224 bytes).
        private_data @ 8, 224;
    }
}

layout! {
    /// SIDR_REQ: ServiceIDResReq (attribute 0x0017, table 119).
    pub struct SidrReq ("SIDR_REQ", 232) {
        /// Request ID (Linux: the cm_id's local comm ID).
        request_id: u32 = (0, 0, 32),
        /// Partition key.
        pkey: u16 = (4, 0, 16),
        /// Reserved.
        reserved0: u16 = (6, 0, 16),
        /// Service ID.
        service_id: u64 = (8, 0, 64),
    }
    blobs {
        /// Private data (216 bytes; rdma_cm puts its 36-byte header first).
        private_data @ 16, 216;
    }
}

layout! {
    /// SIDR_REP: ServiceIDResReqResp (attribute 0x0018, table 120).
    pub struct SidrRep ("SIDR_REP", 232) {
        /// Request ID, echoed.
        request_id: u32 = (0, 0, 32),
        /// Status.
        status: SidrStatus = (4, 0, 8),
        /// Additional information length in bytes.
        additional_info_length: u8 = (5, 0, 8),
        /// ECE vendor ID bits 23..8 (reserved before Linux 5.9).
        vendor_id_h: u16 = (6, 0, 16),
        /// QPN (24 bits).
        qpn: u32 = (8, 0, 24),
        /// ECE vendor ID bits 7..0.
        vendor_id_l: u8 = (11, 0, 8),
        /// Service ID (4-byte aligned).
        service_id: u64 = (12, 0, 64),
        /// Q_Key (rdma_cm: 0x01234567).
        qkey: u32 = (20, 0, 32),
    }
    blobs {
        /// Additional information (72 bytes; ClassPortInfo on redirect).
        additional_info @ 24, 72;
        /// Private data (136 bytes, no header).
        private_data @ 96, 136;
    }
}

layout! {
    /// The alternate path of a LAP: laid out unlike a REQ path (traffic class where the REQ
    /// has the rate). 44 bytes at data offset 20.
    pub struct LapPath ("LAP path", 44) {
        /// Alternate local port LID.
        local_lid: u16 = (0, 0, 16),
        /// Alternate remote port LID.
        remote_lid: u16 = (2, 0, 16),
        /// Alternate flow label (20 bits).
        flow_label: u32 = (36, 0, 20),
        /// Reserved (4 bits).
        reserved0: u8 = (38, 4, 4),
        /// Alternate traffic class.
        traffic_class: u8 = (39, 0, 8),
        /// Alternate hop limit.
        hop_limit: u8 = (40, 0, 8),
        /// Reserved (2 bits).
        reserved1: u8 = (41, 0, 2),
        /// Alternate packet rate (6 bits).
        packet_rate: u8 = (41, 2, 6),
        /// Alternate SL (4 bits).
        sl: u8 = (42, 0, 4),
        /// Alternate subnet local.
        subnet_local: bool = (42, 4, 1),
        /// Reserved (3 bits).
        reserved2: u8 = (42, 5, 3),
        /// Alternate local ACK timeout (5 bits).
        local_ack_timeout: u8 = (43, 0, 5),
        /// Reserved (3 bits).
        reserved3: u8 = (43, 5, 3),
    }
    gids {
        /// Alternate local port GID.
        local_gid @ 4,
        /// Alternate remote port GID.
        remote_gid @ 20,
    }
}

layout! {
    /// LAP: LoadAlternatePath (attribute 0x0019, table 115). Ignored on RoCE, as by Linux.
    pub struct Lap ("LAP", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID.
        remote_comm_id: u32 = (4, 0, 32),
        /// Reserved.
        reserved0: u32 = (8, 0, 32),
        /// Remote QPN/EECN (24 bits).
        remote_qpn: u32 = (12, 0, 24),
        /// Remote CM response timeout (5 bits).
        remote_cm_response_timeout: u8 = (15, 0, 5),
        /// Reserved (3 bits).
        reserved1: u8 = (15, 5, 3),
        /// Reserved.
        reserved2: u32 = (16, 0, 32),
    }
    blobs {
        /// Private data (168 bytes).
        private_data @ 64, 168;
    }
    nested {
        /// The alternate path to load.
        alternate_path: LapPath = 20,
    }
}

layout! {
    /// APR: AlternatePathResponse (attribute 0x001A, table 116).
    pub struct Apr ("APR", 232) {
        /// Local communication ID.
        local_comm_id: u32 = (0, 0, 32),
        /// Remote communication ID.
        remote_comm_id: u32 = (4, 0, 32),
        /// Additional information length.
        additional_info_length: u8 = (8, 0, 8),
        /// AP status.
        ap_status: ApStatus = (9, 0, 8),
        /// Reserved.
        reserved0: u16 = (10, 0, 16),
    }
    blobs {
        /// Additional information (72 bytes).
        additional_info @ 12, 72;
        /// Private data (148 bytes).
        private_data @ 84, 148;
    }
}

layout! {
    /// ClassPortInfo (generic attribute 0x0001, 72 bytes). Linux's CM has no handler: a Get is
    /// answered by the MAD layer with GetResp and status 0x000C.
    pub struct ClassPortInfo ("ClassPortInfo", 72) {
        /// Base version.
        base_version: u8 = (0, 0, 8),
        /// Class version.
        class_version: u8 = (1, 0, 8),
        /// Capability mask.
        capability_mask: u16 = (2, 0, 16),
        /// Capability mask 2 (27 bits).
        capability_mask2: u32 = (4, 0, 27),
        /// Response time value (5 bits).
        resp_time_value: u8 = (7, 3, 5),
        /// Redirect traffic class.
        redirect_tc: u8 = (24, 0, 8),
        /// Redirect SL (4 bits).
        redirect_sl: u8 = (25, 0, 4),
        /// Redirect flow label (20 bits).
        redirect_fl: u32 = (25, 4, 20),
        /// Redirect LID.
        redirect_lid: u16 = (28, 0, 16),
        /// Redirect P_Key.
        redirect_pkey: u16 = (30, 0, 16),
        /// Reserved.
        reserved0: u8 = (32, 0, 8),
        /// Redirect QP (24 bits).
        redirect_qp: u32 = (33, 0, 24),
        /// Redirect Q_Key.
        redirect_qkey: u32 = (36, 0, 32),
        /// Trap traffic class.
        trap_tc: u8 = (56, 0, 8),
        /// Trap SL (4 bits).
        trap_sl: u8 = (57, 0, 4),
        /// Trap flow label (20 bits).
        trap_fl: u32 = (57, 4, 20),
        /// Trap LID.
        trap_lid: u16 = (60, 0, 16),
        /// Trap P_Key.
        trap_pkey: u16 = (62, 0, 16),
        /// Trap hop limit.
        trap_hl: u8 = (64, 0, 8),
        /// Trap QP (24 bits).
        trap_qp: u32 = (65, 0, 24),
        /// Trap Q_Key.
        trap_qkey: u32 = (68, 0, 32),
    }
    gids {
        /// Redirect GID.
        redirect_gid @ 8,
        /// Trap GID.
        trap_gid @ 40,
    }
}

impl Rej {
    /// The meaningful part of the ARI (`reject_info_length` bytes, capped at the area).
    pub fn ari_bytes(&self) -> &[u8] {
        &self.ari[..usize::from(self.reject_info_length).min(self.ari.len())]
    }
}

impl Rep {
    /// The 24-bit ECE vendor ID spread over three reserved bytes.
    pub fn vendor_id(&self) -> u32 {
        u32::from(self.vendor_id_h) << 16
            | u32::from(self.vendor_id_m) << 8
            | u32::from(self.vendor_id_l)
    }
}
