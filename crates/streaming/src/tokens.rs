//! Single-use, expiring tokens for pending streaming requests.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::Engine as _;

use crate::StreamingError;

/// Pending requests by token. A token is removed when it is used, and is
/// refused (and dropped) once older than the idle timeout.
#[derive(Debug)]
pub(crate) struct TokenStore<T> {
    ttl: Duration,
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
    /// An empty store whose tokens live for `ttl`.
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            map: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, T)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `value` under a fresh token at `now` and returns the token;
    /// expired entries are dropped on the way.
    pub(crate) fn insert_at(&self, value: T, now: Instant) -> Result<String, StreamingError> {
        let token = new_token()?;
        let mut map = self.lock();
        let ttl = self.ttl;
        map.retain(|_, (at, _)| now.saturating_duration_since(*at) < ttl);
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
        let s = TokenStore::new(Duration::from_secs(60));
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
        let s = TokenStore::new(Duration::from_secs(10));
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
}
