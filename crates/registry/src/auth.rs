//! Registry credentials and `WWW-Authenticate` challenges (Bearer token
//! auth and Basic).

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine as _;

/// Credentials for one pull, as CRI's `AuthConfig` carries them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RegistryAuth {
    /// User name.
    pub username: String,
    /// Password.
    pub password: String,
    /// `base64(username:password)`, used when `username` is empty.
    pub auth: String,
    /// OAuth2 refresh token for the registry's token server.
    pub identity_token: String,
    /// A bearer token to send as is.
    pub registry_token: String,
    /// The registry these credentials are for (`host[:port]`, optionally
    /// with a scheme and path, as kubelet fills it in). Empty means the
    /// registry of the image reference. No other host is sent them.
    pub server_address: String,
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print secrets.
        f.debug_struct("RegistryAuth")
            .field("username", &self.username)
            .field("has_password", &!self.password.is_empty())
            .field("has_auth", &!self.auth.is_empty())
            .field("has_identity_token", &!self.identity_token.is_empty())
            .field("has_registry_token", &!self.registry_token.is_empty())
            .field("server_address", &self.server_address)
            .finish()
    }
}

impl RegistryAuth {
    /// User name and password, from the fields or decoded from `auth`.
    pub fn credentials(&self) -> Option<(String, String)> {
        if !self.username.is_empty() {
            return Some((self.username.clone(), self.password.clone()));
        }
        if self.auth.is_empty() {
            return None;
        }
        let raw = base64::engine::general_purpose::STANDARD
            .decode(self.auth.trim())
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (u, p) = text.split_once(':')?;
        Some((u.to_owned(), p.to_owned()))
    }

    /// True when there is anything to send (credentials or tokens).
    pub(crate) fn is_empty(&self) -> bool {
        self.credentials().is_none()
            && self.identity_token.is_empty()
            && self.registry_token.is_empty()
    }

    /// The authority named by `server_address` (`None` when it is empty),
    /// normalised as [`normalize_authority`] does.
    pub(crate) fn server_authority(&self) -> Option<String> {
        let s = self.server_address.trim();
        if s.is_empty() {
            return None;
        }
        let (scheme, rest) = match s.split_once("://") {
            Some((scheme, rest)) => (Some(scheme), rest),
            None => (None, s),
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
        Some(normalize_authority(scheme, authority))
    }

    /// `Basic ...` header value, if there are credentials.
    pub(crate) fn basic_header(&self) -> Option<String> {
        self.credentials().map(|(u, p)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        })
    }
}

/// `authority` in lower case without the default port of `scheme` (with
/// no scheme, `:443` is taken as the default, as registries are HTTPS).
pub(crate) fn normalize_authority(scheme: Option<&str>, authority: &str) -> String {
    let a = authority.trim().to_ascii_lowercase();
    let default = match scheme {
        Some("http") => ":80",
        _ => ":443",
    };
    match a.strip_suffix(default) {
        Some(stripped) if !stripped.is_empty() => stripped.to_owned(),
        _ => a,
    }
}

/// A parsed `WWW-Authenticate` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Challenge {
    /// Token auth: ask `realm` for a token.
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
    /// Send user and password on every request.
    Basic,
}

/// Parses a `WWW-Authenticate` header value.
pub(crate) fn parse_challenge(value: &str) -> Option<Challenge> {
    let value = value.trim();
    let (scheme, rest) = value.split_once(' ').unwrap_or((value, ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let params = parse_params(rest);
    Some(Challenge::Bearer {
        realm: params.get("realm")?.clone(),
        service: params.get("service").cloned(),
        scope: params.get("scope").cloned(),
    })
}

/// Parses `k="v",k2=v2` (quoted values may contain commas).
fn parse_params(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            break;
        }
        let mut val = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => val.extend(chars.next()),
                    '"' => break,
                    c => val.push(c),
                }
            }
        } else {
            while let Some(c) = chars.peek() {
                if *c == ',' {
                    break;
                }
                val.push(*c);
                chars.next();
            }
        }
        out.insert(key.trim().to_ascii_lowercase(), val.trim().to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bearer_challenges() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/busybox:pull,push""#,
        )
        .unwrap();
        assert_eq!(
            c,
            Challenge::Bearer {
                realm: "https://auth.docker.io/token".to_owned(),
                service: Some("registry.docker.io".to_owned()),
                scope: Some("repository:library/busybox:pull,push".to_owned()),
            }
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="x""#),
            Some(Challenge::Basic)
        );
        assert_eq!(parse_challenge("Negotiate"), None);
        assert_eq!(parse_challenge("Bearer service=x"), None);
    }

    #[test]
    fn server_address_names_an_authority() {
        let at = |s: &str| {
            RegistryAuth {
                server_address: s.into(),
                ..Default::default()
            }
            .server_authority()
        };
        assert_eq!(at(""), None);
        assert_eq!(at("Registry.Example"), Some("registry.example".into()));
        assert_eq!(at("https://r.example:443/v1/"), Some("r.example".into()));
        assert_eq!(at("http://r.example:80"), Some("r.example".into()));
        assert_eq!(at("127.0.0.1:5000"), Some("127.0.0.1:5000".into()));
        assert_eq!(
            at("https://index.docker.io/v1/"),
            Some("index.docker.io".into())
        );
        assert_eq!(normalize_authority(Some("http"), "a:443"), "a:443");
    }

    #[test]
    fn credentials_from_fields_or_auth() {
        let a = RegistryAuth {
            username: "u".into(),
            password: "p".into(),
            ..Default::default()
        };
        assert_eq!(a.credentials(), Some(("u".into(), "p".into())));
        assert_eq!(a.basic_header().unwrap(), "Basic dTpw");
        let b = RegistryAuth {
            auth: "dXNlcjpwYTpzcw==".into(),
            ..Default::default()
        };
        assert_eq!(b.credentials(), Some(("user".into(), "pa:ss".into())));
        assert_eq!(RegistryAuth::default().credentials(), None);
        let dbg = format!(
            "{:?}",
            RegistryAuth {
                password: "secret".into(),
                ..Default::default()
            }
        );
        assert!(!dbg.contains("secret"));
    }
}
