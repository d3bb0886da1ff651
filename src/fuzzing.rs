//! Entry points for the fuzz targets (`fuzz/`, `make fuzz`) and for their regression test, which
//! replays every file of `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` in the normal
//! test suite. Each takes arbitrary bytes, drives one parser of what the network or a user sends
//! through the code the appliance runs on it, and must return without panicking.

use std::sync::OnceLock;

/// A fuzz target's entry point.
pub type Target = fn(&[u8]);

/// The fuzz targets, by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("dhcp", dhcp),
    ("tftp", tftp),
    ("frame", frame),
    ("jwe", jwe),
    ("csr", csr),
    ("claims", claims),
    ("api", api),
    ("tpm", tpm),
];

/// A DHCP packet: decoded, then every decision the boot server makes on it (both modes).
pub fn dhcp(data: &[u8]) {
    let Some(m) = crate::edge::boot::dhcp::decode(data) else {
        return;
    };
    if crate::edge::boot::dhcp::mac_of(&m).is_none() {
        return;
    }
    let _ = crate::edge::boot::dhcp::classify(&m);
    let files = crate::edge::boot::dhcp::Files {
        undionly: true,
        ipxe_efi: true,
        snponly: true,
        arm64: true,
        shim: true,
    };
    let ctx = crate::edge::boot::dhcp::ReplyCtx {
        server_ip: std::net::Ipv4Addr::new(10, 0, 0, 1),
        http_base: "http://10.0.0.1",
        files: &files,
        uefi_shim: false,
        tftp: true,
        lease: Some(std::net::Ipv4Addr::new(10, 0, 0, 50)),
        netmask: Some(std::net::Ipv4Addr::new(255, 255, 255, 0)),
        router: None,
        dns: &[],
        lease_seconds: 3600,
    };
    for (proxy, port_4011) in [(true, false), (true, true), (false, false)] {
        if let Some(reply) = crate::edge::boot::dhcp::reply(&m, proxy, port_4011, &ctx) {
            use dhcproto::Encodable;
            let mut out = Vec::new();
            let _ = reply.encode(&mut dhcproto::Encoder::new(&mut out));
        }
    }
}

/// A TFTP packet and, for a read request, the path guard.
pub fn tftp(data: &[u8]) {
    if let Ok(crate::edge::boot::tftp::Packet::Rrq(r)) = crate::edge::boot::tftp::parse(data) {
        let _ = crate::edge::boot::tftp::confine(&r.filename);
    }
}

/// A gateway frame: the length prefix, then the request as the gateway parses it.
pub fn frame(data: &[u8]) {
    let rt = runtime();
    let mut cursor = std::io::Cursor::new(data.to_vec());
    let Ok(body) = rt.block_on(crate::proto::protocol::read_frame(&mut cursor)) else {
        return;
    };
    if let Ok(req) = serde_json::from_slice::<crate::proto::protocol::Request>(&body) {
        let _ = req.operations();
    }
}

/// A sealed join token (compact JWE) opened with the appliance's key.
pub fn jwe(data: &[u8]) {
    static KEY: OnceLock<(
        crate::base::crypto::SigningKey,
        aws_lc_rs::agreement::PrivateKey,
    )> = OnceLock::new();
    let (_, dec) = KEY.get_or_init(|| {
        let k = crate::base::crypto::SigningKey::generate();
        let d = crate::proto::jwe::decryption_key(k.pkcs8()).expect("a fresh key");
        (k, d)
    });
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let _ = crate::proto::jwe::open(s, dec, &[7u8; 32], 1_800_000_000, 300);
}

/// A CSR (DER), verified as the JoinService does.
pub fn csr(data: &[u8]) {
    let _ = crate::proto::csr::verify(data);
}

/// A machine's claims (JSON): normalised, filtered, the hardware key derived.
pub fn claims(data: &[u8]) {
    let Ok(c) = serde_json::from_slice::<crate::proto::claims::Claims>(data) else {
        return;
    };
    let _ = c.within_limits();
    let ids = crate::proto::claims::Identifiers::from_claims(&c);
    let _ = crate::proto::claims::hardware_key(&ids);
}

/// An admin API body, sent to each method against a scratch database.
pub fn api(data: &[u8]) {
    static STORE: OnceLock<(tempfile::TempDir, crate::store::Store, String)> = OnceLock::new();
    let (_, store, root) = STORE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a scratch directory");
        let store = crate::store::Store::open(&dir.path().join("fuzz.db"), true)
            .expect("a scratch database");
        let root = "tn_00000000000000000000000000".to_string();
        (dir, store, root)
    });
    let ctx = crate::admin::ctx::Ctx {
        caller: "uid:0",
        now: 1_800_000_000,
        site_id: "site_00000000000000000000000000",
        root_tenant: root,
        sessions: None,
    };
    for method in [
        "tenants/create",
        "pools/create",
        "pools/update",
        "joinTokens/create",
        "joinTokens/createMany",
        "joinTokens/list",
        "events/list",
        "audit/list",
        "nodes/list",
        "joinRequests/approve",
        "bootLeases/list",
        "tpmEks/allow",
        "tpmEks/list",
        "tpmEks/remove",
    ] {
        let _ = crate::admin::dispatch(store, &ctx, method, data);
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    })
}

/// A TPM response to each command bca sends (code, parameters, the public area of a key); and
/// what a machine sends the `tpm` attestor: the pieces of a certification (split at the first
/// bytes' lengths) as the JoinService checks them, a public area, an EK certificate.
pub fn tpm(data: &[u8]) {
    crate::tpm::parse_any(data);
    let _ = crate::tpm::public_key_of(data);
    let _ = crate::join::tpm::EkCas::default().certifies(data);
    let mut parts = Vec::new();
    let mut rest = data;
    for _ in 0..3 {
        let Some((&n, tail)) = rest.split_first() else {
            return;
        };
        let n = (n as usize).min(tail.len());
        parts.push(&tail[..n]);
        rest = &tail[n..];
    }
    let _ = crate::tpm::attest::verify_certify(parts[0], parts[1], parts[2], &[0u8; 32], rest);
    let b64 = crate::base::crypto::b64;
    let _ = crate::join::tpm::prepare_challenge(
        &crate::proto::protocol::TpmChallengeRequest {
            ek_public: b64(parts[0]),
            ek_certificate: Some(b64(parts[1])),
            ak_public: b64(rest),
        },
        &crate::join::tpm::EkCas::default(),
    );
}
