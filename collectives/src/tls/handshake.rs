//! The TLS transport's handshake: rustls's unbuffered API driven over a tokio TCP stream until the
//! handshake completes, then the traffic keys taken out for the data path ([`super::record`]).
//!
//! The unbuffered API consumes only whole records and says how many bytes it used, so bytes the
//! peer sent after its last handshake record (its first data records, which may share a read with
//! its Finished) stay in our buffer and are handed on ([`Established::leftover`]): nothing the peer
//! sent is lost between the handshake and the reader thread. Both configurations come from
//! [`crate::server_tls_config`] / [`crate::client_tls_config`] (mutual TLS 1.3 under the cluster
//! CA), with secret extraction on and no session tickets (they would arrive as data-path records).

use std::sync::{Arc, Mutex};

use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::record::{record_len, KeySchedule, Opened, Opener, RecordBuf, RecordError, Sealer};

/// A connection whose handshake is done: its two record halves, the peer's certificate chain,
/// and the bytes already read past the handshake.
pub(crate) struct Established {
    pub(crate) sealer: Sealer,
    pub(crate) opener: Opener,
    pub(crate) peer_certs: Vec<CertificateDer<'static>>,
    /// Record bytes read after the handshake's last record, to be opened before anything else.
    pub(crate) leftover: Vec<u8>,
    /// Data rustls already opened (records that came with the peer's last handshake record);
    /// it precedes `leftover`.
    pub(crate) opened: Vec<u8>,
}

/// Runs the client side of a handshake towards the rank named `name`.
pub(crate) async fn client(stream: &mut TcpStream, config: Arc<rustls::ClientConfig>, name: ServerName<'static>, update_every: u64) -> Result<Established, String> {
    let mut conn = UnbufferedClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let (leftover, opened) = drive(stream, &mut conn).await?;
    let peer_certs = conn.peer_certificates().map(<[_]>::to_vec).unwrap_or_default();
    let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(|e| e.to_string())?;
    established(secrets, KeySchedule::Client(kernel), peer_certs, leftover, opened, update_every)
}

/// Runs the server side of a handshake.
pub(crate) async fn server(stream: &mut TcpStream, config: Arc<rustls::ServerConfig>, update_every: u64) -> Result<Established, String> {
    let mut conn = UnbufferedServerConnection::new(config).map_err(|e| e.to_string())?;
    let (leftover, opened) = drive(stream, &mut conn).await?;
    let peer_certs = conn.peer_certificates().map(<[_]>::to_vec).unwrap_or_default();
    let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(|e| e.to_string())?;
    established(secrets, KeySchedule::Server(kernel), peer_certs, leftover, opened, update_every)
}

fn established(
    secrets: rustls::ExtractedSecrets,
    schedule: KeySchedule,
    peer_certs: Vec<CertificateDer<'static>>,
    leftover: Vec<u8>,
    opened: Vec<u8>,
    update_every: u64,
) -> Result<Established, String> {
    // Half the suite's limit: the update always lands well inside it.
    let update_every = update_every.min(schedule.confidentiality_limit() / 2);
    let schedule = Arc::new(Mutex::new(schedule));
    let (tx_seq, tx) = secrets.tx;
    let (rx_seq, rx) = secrets.rx;
    let sealer = Sealer::new(tx_seq, tx, Arc::clone(&schedule), update_every).map_err(|e| e.to_string())?;
    let opener = Opener::new(rx_seq, rx, schedule).map_err(|e| e.to_string())?;
    Ok(Established { sealer, opener, peer_certs, leftover, opened })
}

/// The two unbuffered connection types, as [`drive`] uses them.
trait Handshaking {
    type Data;
    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn handshaking(&self) -> bool;
}

impl Handshaking for UnbufferedClientConnection {
    type Data = rustls::client::ClientConnectionData;
    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn handshaking(&self) -> bool {
        self.is_handshaking()
    }
}

impl Handshaking for UnbufferedServerConnection {
    type Data = rustls::server::ServerConnectionData;
    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn handshaking(&self) -> bool {
        self.is_handshaking()
    }
}

/// A handshake flight larger than this is refused (ours are a few KiB: two certificates).
const MAX_FLIGHT_BYTES: usize = 1 << 20;

/// Drives `conn` until its handshake is complete. Returns the bytes read past the handshake's
/// records and the plaintext of data records rustls opened itself (it opens a data record that
/// arrived in the same read as the peer's last handshake record).
async fn drive<C: Handshaking>(stream: &mut TcpStream, conn: &mut C) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut incoming = vec![0u8; 16 * 1024];
    let mut used = 0usize;
    let mut outgoing = vec![0u8; 8 * 1024];
    let mut out_used = 0usize;
    let mut opened = Vec::new();
    loop {
        let UnbufferedStatus { mut discard, state } = conn.process(&mut incoming[..used]);
        let mut read_more = false;
        let mut maybe_complete = false;
        match state.map_err(|e| e.to_string())? {
            ConnectionState::EncodeTlsData(mut encode) => loop {
                match encode.encode(&mut outgoing[out_used..]) {
                    Ok(n) => {
                        out_used += n;
                        break;
                    }
                    Err(EncodeError::InsufficientSize(e)) => outgoing.resize(out_used + e.required_size, 0),
                    Err(e) => return Err(format!("encoding a handshake record: {e:?}")),
                }
            },
            ConnectionState::TransmitTlsData(transmit) => {
                stream.write_all(&outgoing[..out_used]).await.map_err(|e| e.to_string())?;
                out_used = 0;
                transmit.done();
            }
            ConnectionState::BlockedHandshake => read_more = true,
            ConnectionState::ReadTraffic(mut traffic) => {
                while let Some(record) = traffic.next_record() {
                    let record = record.map_err(|e| e.to_string())?;
                    discard += record.discard;
                    opened.extend_from_slice(record.payload);
                }
            }
            ConnectionState::WriteTraffic(_) => maybe_complete = true,
            ConnectionState::PeerClosed | ConnectionState::Closed => return Err("the peer closed the connection during the handshake".into()),
            _ => return Err("unexpected TLS state during the handshake".into()),
        }
        incoming.copy_within(discard..used, 0);
        used -= discard;
        if maybe_complete {
            if !conn.handshaking() {
                break;
            }
            // A server may write before the client's last flight: wait for it.
            read_more = true;
        }
        if read_more {
            if used == incoming.len() {
                if incoming.len() >= MAX_FLIGHT_BYTES {
                    return Err("handshake flight too large".into());
                }
                incoming.resize(incoming.len() * 2, 0);
            }
            let n = stream.read(&mut incoming[used..]).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("the peer closed the connection during the handshake".into());
            }
            used += n;
        }
    }
    incoming.truncate(used);
    Ok((incoming, opened))
}

/// Writes `plaintext` to `stream` as sealed records.
pub(crate) async fn write_sealed(stream: &mut TcpStream, sealer: &mut Sealer, plaintext: &[u8]) -> Result<(), String> {
    let mut out = RecordBuf::default();
    sealer.seal(plaintext, &mut out).map_err(|e| e.to_string())?;
    stream.write_all(out.as_slice()).await.map_err(|e| e.to_string())
}

/// Reads exactly `n` bytes of data: first from `opened`, then by reading and opening records from
/// `stream` (after the bytes already in `buf`); leaves the bytes after the last record used in
/// `buf`. Data past the `n` bytes within one record is an error (the hello exchange is lockstep).
pub(crate) async fn read_exact_opened(stream: &mut TcpStream, opener: &mut Opener, opened: &mut Vec<u8>, buf: &mut Vec<u8>, n: usize) -> Result<Vec<u8>, String> {
    while opened.len() < n {
        let more = read_opened(stream, opener, buf).await?;
        opened.extend_from_slice(&more);
    }
    if opened.len() > n {
        return Err(format!("{} bytes of data where {n} were expected", opened.len()));
    }
    Ok(std::mem::take(opened))
}

/// Reads and opens records from `stream` (after the bytes already in `buf`) until one carries
/// data; returns that data and leaves the bytes after its record in `buf`.
async fn read_opened(stream: &mut TcpStream, opener: &mut Opener, buf: &mut Vec<u8>) -> Result<Vec<u8>, String> {
    loop {
        while let Some(len) = record_len(buf).map_err(|e| e.to_string())? {
            if buf.len() < len {
                break;
            }
            let opened = opener.open(&mut buf[..len]).map_err(|e: RecordError| e.to_string())?;
            let data = match opened {
                Opened::Data(range) if !range.is_empty() => Some(buf[range].to_vec()),
                Opened::Data(_) | Opened::KeyUpdated => None,
                Opened::Closed => return Err("peer closed the connection".into()),
            };
            buf.drain(..len);
            if let Some(data) = data {
                return Ok(data);
            }
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("peer closed the connection".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    //! A real handshake between two loopback TCP sockets, then the record layer it hands over:
    //! data round trips through sealing of several parts into a reused buffer and of one plain
    //! buffer, key updates every two records, and every kind of bad record (altered, replayed,
    //! wrong header) is refused with its error.
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::quic::{client_tls_config, rank_name, server_tls_config, ClusterCa};
    use crate::tls::record::{record_len, Opened, RecordBuf, RecordError};

    /// Both ends of a handshake between rank 0 (client) and rank 1 (server), key update every
    /// `update_every` records.
    async fn pair(update_every: u64) -> (Established, Established) {
        let ca = ClusterCa::generate("record test").unwrap();
        let mut server_config = server_tls_config(&ca.issue(1).unwrap()).unwrap();
        server_config.enable_secret_extraction = true;
        server_config.send_tls13_tickets = 0;
        let mut client_config = client_tls_config(&ca.issue(0).unwrap()).unwrap();
        client_config.enable_secret_extraction = true;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            server(&mut stream, Arc::new(server_config), update_every).await.unwrap()
        });
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from(rank_name(1)).unwrap();
        let client = client(&mut stream, Arc::new(client_config), name, update_every).await.unwrap();
        (client, server.await.unwrap())
    }

    /// Opens every record of `wire` in order; returns the data and the first error.
    fn open_all(opener: &mut Opener, wire: &mut [u8]) -> (Vec<u8>, Option<RecordError>) {
        let mut data = Vec::new();
        let mut pos = 0;
        while pos < wire.len() {
            let len = match record_len(&wire[pos..]) {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(e) => return (data, Some(e)),
            };
            match opener.open(&mut wire[pos..pos + len]) {
                Ok(Opened::Data(range)) => data.extend_from_slice(&wire[pos..pos + len][range]),
                Ok(_) => {}
                Err(e) => return (data, Some(e)),
            }
            pos += len;
        }
        (data, None)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_round_trip_across_key_updates_and_bad_ones_are_refused() {
        let (mut client, mut server) = pair(2).await;
        let plain: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        // Sealed from parts (records of each part's own, key updates between records) into a
        // buffer that held other records before (its stale bytes must not leak into these).
        let mut records = RecordBuf::default();
        client.sealer.seal(&[0xEE; 70_000], &mut records).unwrap();
        let mut wire = records.as_slice().to_vec();
        let (garbage, err) = open_all(&mut server.opener, &mut wire);
        assert!(err.is_none() && garbage == [0xEE; 70_000]);
        records.clear();
        client.sealer.seal_parts([&plain[..7], &plain[7..40_000], &[][..], &plain[40_000..]], &mut records).unwrap();
        let mut wire = records.as_slice().to_vec();
        // Then sealed from a plain buffer.
        let mut plain_records = RecordBuf::default();
        client.sealer.seal(&plain, &mut plain_records).unwrap();
        wire.extend_from_slice(plain_records.as_slice());
        let keep = wire.clone();
        let (data, err) = open_all(&mut server.opener, &mut wire);
        assert_eq!(err, None);
        assert_eq!(data.len(), 2 * plain.len());
        assert!(data[..plain.len()] == plain[..] && data[plain.len()..] == plain[..]);

        // Replaying what was already opened: the sequence number moved on, nothing authenticates.
        let mut replay = keep.clone();
        let (data, err) = open_all(&mut server.opener, &mut replay);
        assert!(data.is_empty() && matches!(err, Some(RecordError::Unauthentic { .. })), "{err:?}");

        // A fresh pair: an altered byte fails that record; a bad header is refused before opening.
        let (mut client, mut server) = pair(1 << 20).await;
        let mut records = RecordBuf::default();
        client.sealer.seal(&plain[..1000], &mut records).unwrap();
        let mut wire = records.as_slice().to_vec();
        wire[100] ^= 1;
        assert!(matches!(open_all(&mut server.opener, &mut wire).1, Some(RecordError::Unauthentic { seq: 0 })));
        for header in [[22u8, 3, 3, 0, 40], [23, 3, 1, 0, 40], [23, 3, 3, 0xff, 0xff], [23, 3, 3, 0, 3]] {
            assert!(matches!(record_len(&header), Err(RecordError::BadHeader(h)) if h == header), "{header:?}");
        }
        assert_eq!(record_len(&[23, 3, 3]), Ok(None));
    }
}
