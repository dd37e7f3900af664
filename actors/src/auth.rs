//! Channel-bound token proofs: how two ends of a [`crate::Link`] show each other that they know a
//! shared secret token without sending it. Both sides derive 32 bytes from the TLS exporter of
//! their very connection ([`crate::Link::export_keying_material`] with [`EXPORTER_LABEL`]); a side
//! proves itself with `HMAC-SHA256(token, role ‖ ekm)`, where `role` names who speaks (the joining
//! side and the answering side use different roles, so a proof cannot be reflected back). A proof
//! made for one connection is useless on another, so a man in the middle learns nothing it can
//! replay. The data-parallel supervisor's join and the federation's client hosts both use it.

use ring::hmac;

/// Label of the TLS exporter the proofs are bound to.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-rtx-join";

/// The proof that the side playing `role` knows `token`, for a connection with exporter value `ekm`.
pub fn prove(token: &str, role: &[u8], ekm: &[u8; 32]) -> Vec<u8> {
    let key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
    let mut ctx = hmac::Context::with_key(&key);
    ctx.update(role);
    ctx.update(ekm);
    ctx.sign().as_ref().to_vec()
}

/// Checks `given` against the proof for `role` in constant time.
pub fn verify(token: &str, role: &[u8], ekm: &[u8; 32], given: &[u8]) -> bool {
    let key = hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes());
    let message = [role, &ekm[..]].concat();
    hmac::verify(&key, &message, given).is_ok()
}

/// A fresh random token: 32 bytes from the OS, hex.
pub fn generate_token() -> Result<String, String> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new().fill(&mut bytes).map_err(|_| "the OS random generator failed".to_string())?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_only_for_its_token_role_and_connection() {
        let ekm = [7u8; 32];
        let proof = prove("secret", b"host", &ekm);
        assert!(verify("secret", b"host", &ekm, &proof));
        assert!(!verify("other", b"host", &ekm, &proof), "wrong token");
        assert!(!verify("secret", b"coordinator", &ekm, &proof), "reflected to the other role");
        assert!(!verify("secret", b"host", &[8u8; 32], &proof), "replayed on another connection");
        assert!(!verify("secret", b"host", &ekm, &proof[..31]), "truncated");
    }

    #[test]
    fn tokens_are_fresh_hex() {
        let a = generate_token().expect("token");
        let b = generate_token().expect("token");
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
