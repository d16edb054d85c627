//! Single-use, expiring tokens for pending streaming requests.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::Engine as _;

use crate::StreamingError;

/// Pending requests by token. A token is removed when it is used, and is
/// refused (and dropped) once older than the idle timeout; at most
/// `max_in_flight` are held (kubelet's request cache: 1000).
#[derive(Debug)]
pub(crate) struct TokenStore<T> {
    ttl: Duration,
    max_in_flight: usize,
    map: Mutex<HashMap<String, (Instant, T)>>,
}

/// A new random token: 24 bytes of the kernel's CSPRNG (`getrandom(2)`),
/// base64url.
pub(crate) fn new_token() -> Result<String, StreamingError> {
    let mut buf = [0u8; 24];
    getrandom::fill(&mut buf).map_err(StreamingError::Random)?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(buf))
}

impl<T> TokenStore<T> {
    /// An empty store whose tokens live for `ttl`, holding at most
    /// `max_in_flight`.
    pub(crate) fn new(ttl: Duration, max_in_flight: usize) -> Self {
        Self {
            ttl,
            max_in_flight,
            map: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, T)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `value` under a fresh token at `now` and returns the token;
    /// expired entries are dropped on the way. Refused when
    /// `max_in_flight` unexpired tokens are held.
    pub(crate) fn insert_at(&self, value: T, now: Instant) -> Result<String, StreamingError> {
        let token = new_token()?;
        let mut map = self.lock();
        let ttl = self.ttl;
        map.retain(|_, (at, _)| now.saturating_duration_since(*at) < ttl);
        if map.len() >= self.max_in_flight {
            return Err(StreamingError::TooManyInFlight {
                max: self.max_in_flight,
            });
        }
        map.insert(token.clone(), (now, value));
        Ok(token)
    }

    /// Stores `value` under a fresh token.
    pub(crate) fn insert(&self, value: T) -> Result<String, StreamingError> {
        self.insert_at(value, Instant::now())
    }

    /// Takes the value of `token` at `now`: `None` when unknown, already
    /// used, or expired.
    pub(crate) fn take_at(&self, token: &str, now: Instant) -> Option<T> {
        let (at, v) = self.lock().remove(token)?;
        (now.saturating_duration_since(at) < self.ttl).then_some(v)
    }

    /// Takes the value of `token` now.
    pub(crate) fn take(&self, token: &str) -> Option<T> {
        self.take_at(token, Instant::now())
    }

    /// Number of stored entries (expired ones included until swept).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_single_use() {
        let s = TokenStore::new(Duration::from_secs(60), 1000);
        let t = s.insert("a").unwrap();
        let u = s.insert("b").unwrap();
        assert_ne!(t, u);
        assert!(t.len() >= 32 && !t.contains('/') && !t.contains('+'));
        assert_eq!(s.take(&t), Some("a"));
        assert_eq!(s.take(&t), None);
        assert_eq!(s.take("nope"), None);
        assert_eq!(s.take(&u), Some("b"));
    }

    #[test]
    fn tokens_expire_and_are_swept() {
        let s = TokenStore::new(Duration::from_secs(10), 1000);
        let t0 = Instant::now();
        let old = s.insert_at(1, t0).unwrap();
        let young = s.insert_at(2, t0).unwrap();
        assert_eq!(s.take_at(&old, t0 + Duration::from_secs(10)), None);
        assert_eq!(s.take_at(&young, t0 + Duration::from_secs(9)), Some(2));
        let stale = s.insert_at(3, t0).unwrap();
        let _fresh = s.insert_at(4, t0 + Duration::from_secs(11)).unwrap();
        assert_eq!(s.len(), 1, "the stale entry is swept by the next insert");
        assert_eq!(s.take_at(&stale, t0 + Duration::from_secs(11)), None);
    }

    #[test]
    fn at_most_max_in_flight_unused_tokens() {
        let s = TokenStore::new(Duration::from_secs(10), 3);
        let t0 = Instant::now();
        let first = s.insert_at(0, t0).unwrap();
        s.insert_at(1, t0).unwrap();
        s.insert_at(2, t0).unwrap();
        let e = s.insert_at(3, t0).unwrap_err();
        assert!(
            matches!(e, StreamingError::TooManyInFlight { max: 3 }),
            "{e}"
        );
        assert!(
            e.to_string().contains("streaming.max_in_flight_urls"),
            "{e}"
        );
        // Using one frees its place; so does expiring.
        assert_eq!(s.take_at(&first, t0), Some(0));
        s.insert_at(4, t0).unwrap();
        s.insert_at(5, t0 + Duration::from_secs(10)).unwrap();
        assert_eq!(s.len(), 1);
    }
}
