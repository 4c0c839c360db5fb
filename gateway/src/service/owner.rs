//! Who owns a loopback client's socket: a session over loopback RUDP belongs to the local user
//! whose socket opened it. At Connect the owner of the client's address is read from the
//! kernel's socket table and kept; before each request and on each Pong it is read again, and
//! a session whose address has passed to another user (a departed client's port bound by
//! another process), or to no one, ends unserved. A client block may also name the uids that
//! may use its key (`uids`).
//!
//! Pure: [`owners`] reads the table as text (`/proc/net/udp`, `/proc/net/udp6`), [`admit`] and
//! [`still_owned`] decide; [`read`] is the one place that reads the files.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use std::time::{Duration, Instant};

use super::Service;

/// How long a finding that a session's address is still its owner's stands for its requests
/// (a Pong is checked always). Shorter than the keepalive (5 s after the gateway last sent to
/// the client, so at least that long after the client's last packet, whose request was
/// checked): whoever learns the next sequence from a keepalive Ping finds every finding
/// expired, so its first request is checked against the socket table afresh.
pub const RECHECK: Duration = Duration::from_secs(1);

/// Whether a session whose owner was last found unchanged at `checked` is due for another
/// look at `now`.
pub fn due(checked: Instant, now: Instant) -> bool {
    now.saturating_duration_since(checked) >= RECHECK
}

/// Who holds a local address, as the socket table says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Sockets of this one user (usually one socket).
    User(u32),
    /// No socket holds it: the client is gone, or the address was never a local socket's.
    Nobody,
    /// Sockets of several users hold it (a port shared with `SO_REUSEADDR`): no one can be
    /// told from the other.
    Shared,
}

/// Why a session is not (or no longer) served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OwnerError {
    /// No local socket holds the client's address.
    #[error("no local socket holds the client's address (the client is gone, or the address is not a local socket's)")]
    Nobody,
    /// Sockets of several users hold it.
    #[error("sockets of several local users hold the client's address")]
    Shared,
    /// Its owner is not among the uids the client block allows.
    #[error("uid {uid} may not use this client's key (its uids are {allowed:?})")]
    NotAllowed {
        /// The socket's owner.
        uid: u32,
        /// The client block's `uids`.
        allowed: Vec<u32>,
    },
    /// The client's address passed to another user since it connected.
    #[error("the client's address now belongs to uid {now}, not to uid {was} who connected")]
    Changed {
        /// Who connected.
        was: u32,
        /// Who holds the address now.
        now: u32,
    },
    /// The client block names `uids`, and the session is not over loopback RUDP (QUIC has no
    /// local user to check).
    #[error("this client's key is for the local users its uids name: connect over loopback RUDP")]
    NotLocal,
    /// The socket table cannot be read, and the client block names `uids`, which cannot be
    /// checked then.
    #[error("the socket table cannot be read ({0}), so this client's uids cannot be checked")]
    Unreadable(String),
}

/// The owner of `addr` in `table` (the text of `/proc/net/udp` or `/proc/net/udp6`, several
/// joined): every socket whose local port is `addr`'s and whose local address is `addr`'s
/// address, the unspecified address of either family, or `addr`'s IPv4 address mapped into
/// IPv6. Lines that do not parse are skipped (the header among them).
pub fn owners(table: &str, addr: SocketAddr) -> Owner {
    let mut found: Option<u32> = None;
    for line in table.lines() {
        let Some((local, uid)) = parse_line(line) else {
            continue;
        };
        if local.port() != addr.port() || !holds(local.ip(), addr.ip()) {
            continue;
        }
        match found {
            Some(u) if u != uid => return Owner::Shared,
            _ => found = Some(uid),
        }
    }
    found.map_or(Owner::Nobody, Owner::User)
}

/// Whether a socket bound to `local` receives what is sent to `addr`.
fn holds(local: IpAddr, addr: IpAddr) -> bool {
    let addr = match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    };
    if local.is_unspecified() || local == addr {
        return true;
    }
    match (local, addr) {
        (IpAddr::V6(l), IpAddr::V4(a)) => l.to_ipv4_mapped() == Some(a),
        _ => false,
    }
}

/// One line of the table: its local address and its owner's uid.
fn parse_line(line: &str) -> Option<(SocketAddr, u32)> {
    let mut fields = line.split_whitespace();
    let slot = fields.next()?;
    if !slot.ends_with(':') {
        return None;
    }
    let local = fields.next()?;
    // rem_address, st, tx_queue:rx_queue, tr:tm->when, retrnsmt, then uid.
    let uid = fields.nth(5)?.parse().ok()?;
    let (ip, port) = local.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match ip.len() {
        // One 32-bit word in the kernel's (host) byte order.
        8 => IpAddr::V4(Ipv4Addr::from(
            u32::from_str_radix(ip, 16).ok()?.to_ne_bytes(),
        )),
        // Four such words.
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                let word = u32::from_str_radix(ip.get(8 * i..8 * i + 8)?, 16).ok()?;
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some((SocketAddr::new(ip, port), uid))
}

/// Whether a session from a socket owned as `owner` (`Err`: the table could not be read) may
/// open, for a client block allowing `allowed` uids (`None`: any local user): the uid it is
/// bound to (`None`: unbound, only when the table cannot be read and the block names no
/// uids).
pub fn admit(
    owner: Result<Owner, String>,
    allowed: Option<&[u32]>,
) -> Result<Option<u32>, OwnerError> {
    match (owner, allowed) {
        (Err(e), Some(_)) => Err(OwnerError::Unreadable(e)),
        (Err(_), None) => Ok(None),
        (Ok(Owner::Nobody), _) => Err(OwnerError::Nobody),
        (Ok(Owner::Shared), _) => Err(OwnerError::Shared),
        (Ok(Owner::User(uid)), Some(a)) if !a.contains(&uid) => Err(OwnerError::NotAllowed {
            uid,
            allowed: a.to_vec(),
        }),
        (Ok(Owner::User(uid)), _) => Ok(Some(uid)),
    }
}

/// Whether a session bound to uid `was` is still its owner's, the table now saying `owner`
/// (`Err`: it could not be read, which ends the session too: it cannot be told).
pub fn still_owned(was: u32, owner: Result<Owner, String>) -> Result<(), OwnerError> {
    match owner {
        Ok(Owner::User(now)) if now == was => Ok(()),
        Ok(Owner::User(now)) => Err(OwnerError::Changed { was, now }),
        Ok(Owner::Nobody) => Err(OwnerError::Nobody),
        Ok(Owner::Shared) => Err(OwnerError::Shared),
        Err(e) => Err(OwnerError::Unreadable(e)),
    }
}

/// The owner of the local UDP address `addr`, read from `/proc/net/udp` and `/proc/net/udp6`
/// (a file that is missing, as udp6 is without IPv6, counts as empty).
pub fn read(addr: SocketAddr) -> Result<Owner, String> {
    let mut table = String::new();
    let mut read_any = false;
    for path in ["/proc/net/udp", "/proc/net/udp6"] {
        match std::fs::read_to_string(path) {
            Ok(t) => {
                read_any = true;
                table.push_str(&t);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{path}: {e}")),
        }
    }
    if !read_any {
        return Err("no /proc/net/udp".to_owned());
    }
    Ok(owners(&table, addr))
}

impl Service {
    /// Whether `peer`'s session is bound to a local user (its socket is read again before its
    /// requests and on its Pongs).
    pub fn is_bound(&self, peer: SocketAddr) -> bool {
        self.peers.get(&peer).is_some_and(|p| p.uid.is_some())
    }

    /// Whether `peer`'s session is bound and its owner was last found unchanged [`RECHECK`]
    /// or longer before `now`: its next request waits for a look at the socket table.
    pub fn owner_due(&self, peer: SocketAddr, now: Instant) -> bool {
        self.peers
            .get(&peer)
            .is_some_and(|p| p.uid.is_some() && due(p.owner_checked, now))
    }

    /// Whether `peer`'s session is still its owner's, the socket table now saying `owner`; if
    /// not, the session is forgotten here (its caller ends it), counted and logged.
    pub fn check_owner(
        &mut self,
        peer: SocketAddr,
        owner: Result<Owner, String>,
    ) -> Result<(), OwnerError> {
        let Some((agent, was)) = self
            .peers
            .get(&peer)
            .and_then(|p| Some((p.agent.clone(), p.uid?)))
        else {
            return Ok(());
        };
        match still_owned(was, owner) {
            Ok(()) => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.owner_checked = Instant::now();
                }
                Ok(())
            }
            Err(why) => {
                tracing::warn!(%peer, %agent, why = %why, "CultNet session ended unserved: its address is not its owner's");
                self.count_cut_off("owner");
                self.forget(peer);
                Err(why)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as Linux writes them on this little-endian machine (recorded here, uids changed;
    /// the address words are in host order: 127.0.0.1 is 0100007F).
    const TABLE: &str = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  101: 0100007F:9C40 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 31337 2 0000000000000000 0
  102: 00000000:9C41 00000000:0000 07 00000000:00000000 00:00000000 00000000  1001        0 31338 2 0000000000000000 0
  103: 0100007F:9C42 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 31339 2 0000000000000000 0
  104: 0100007F:9C42 00000000:0000 07 00000000:00000000 00:00000000 00000000  1002        0 31340 2 0000000000000000 0
  105: 0200007F:9C43 00000000:0000 07 00000000:00000000 00:00000000 00000000  1003        0 31341 2 0000000000000000 0
  106: 0000000000000000FFFF00000100007F:9C44 00000000000000000000000000000000:0000 07 00000000:00000000 00:00000000 00000000  1004        0 31342 2 0000000000000000 0
  107: 00000000000000000000000000000000:9C45 00000000000000000000000000000000:0000 07 00000000:00000000 00:00000000 00000000  1005        0 31343 2 0000000000000000 0
  garbage line
";

    fn at(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn the_owner_is_read_from_the_socket_bound_to_the_clients_address_or_a_wildcard() {
        if cfg!(target_endian = "big") {
            return;
        }
        assert_eq!(owners(TABLE, at(0x9C40)), Owner::User(1000));
        // Bound to 0.0.0.0: it receives what is sent to 127.0.0.1.
        assert_eq!(owners(TABLE, at(0x9C41)), Owner::User(1001));
        // Two users' sockets on one port: no one.
        assert_eq!(owners(TABLE, at(0x9C42)), Owner::Shared);
        // 127.0.0.2 holds that port, not 127.0.0.1.
        assert_eq!(owners(TABLE, at(0x9C43)), Owner::Nobody);
        assert_eq!(
            owners(TABLE, SocketAddr::from(([127, 0, 0, 2], 0x9C43))),
            Owner::User(1003)
        );
        // An IPv6 socket bound to ::ffff:127.0.0.1, or to [::] (dual stack).
        assert_eq!(owners(TABLE, at(0x9C44)), Owner::User(1004));
        assert_eq!(owners(TABLE, at(0x9C45)), Owner::User(1005));
        assert_eq!(owners(TABLE, at(0x9C46)), Owner::Nobody);
        assert_eq!(owners("", at(0x9C40)), Owner::Nobody);
    }

    #[test]
    fn a_session_opens_for_one_allowed_owner_and_is_unbound_only_when_nothing_can_be_read() {
        assert_eq!(admit(Ok(Owner::User(7)), None), Ok(Some(7)));
        assert_eq!(admit(Ok(Owner::User(7)), Some(&[7, 8])), Ok(Some(7)));
        assert_eq!(
            admit(Ok(Owner::User(9)), Some(&[7, 8])),
            Err(OwnerError::NotAllowed {
                uid: 9,
                allowed: vec![7, 8]
            })
        );
        assert_eq!(admit(Ok(Owner::Nobody), None), Err(OwnerError::Nobody));
        assert_eq!(
            admit(Ok(Owner::Shared), Some(&[7])),
            Err(OwnerError::Shared)
        );
        assert_eq!(admit(Err("EACCES".into()), None), Ok(None));
        assert!(matches!(
            admit(Err("EACCES".into()), Some(&[7])),
            Err(OwnerError::Unreadable(_))
        ));
    }

    #[test]
    fn a_finding_stands_for_less_than_the_keepalive() {
        let t = Instant::now();
        assert!(!due(t, t));
        assert!(!due(t, t + RECHECK - Duration::from_millis(1)));
        assert!(due(t, t + RECHECK));
        // A clock read before the finding (another thread's) is not due.
        assert!(!due(t + RECHECK, t));
        assert!(
            RECHECK
                < wire::session::SessionConfig::default()
                    .keepalive
                    .unwrap_or_default()
        );
    }

    #[test]
    fn a_session_ends_when_its_address_passes_to_another_user_or_to_no_one() {
        assert_eq!(still_owned(7, Ok(Owner::User(7))), Ok(()));
        assert_eq!(
            still_owned(7, Ok(Owner::User(65534))),
            Err(OwnerError::Changed { was: 7, now: 65534 })
        );
        assert_eq!(still_owned(7, Ok(Owner::Nobody)), Err(OwnerError::Nobody));
        assert_eq!(still_owned(7, Ok(Owner::Shared)), Err(OwnerError::Shared));
        assert!(still_owned(7, Err("gone".into())).is_err());
    }

    #[test]
    fn this_machines_table_names_this_process_as_the_owner_of_its_socket() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a loopback socket");
        let addr = socket.local_addr().expect("its address");
        let owner = read(addr).expect("this machine's socket table");
        // This process's effective uid, which its sockets are owned by.
        let uid = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(2))
                    .and_then(|u| u.parse::<u32>().ok())
            })
            .expect("this process's uid");
        assert_eq!(owner, Owner::User(uid));
        drop(socket);
        assert_eq!(read(addr), Ok(Owner::Nobody));
    }
}
