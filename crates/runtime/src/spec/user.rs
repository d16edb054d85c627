//! Who the container process runs as: the request, the image's `User`, and
//! their resolution against the image's `/etc/passwd` and `/etc/group`.

use serde::{Deserialize, Serialize};

use crate::error::RuntimeError;

/// Who the container process runs as, as requested (before image defaults).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum UserRequest {
    /// Nothing requested: the image's `User`, else root.
    #[default]
    Image,
    /// A numeric uid, with an optional gid (else the passwd entry's, else 0).
    Id {
        /// User id.
        uid: u32,
        /// Group id.
        gid: Option<u32>,
    },
    /// A user name resolved from the image's `/etc/passwd`.
    Name {
        /// User name.
        name: String,
        /// Group id override.
        gid: Option<u32>,
    },
}

/// A resolved user.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedUser {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Additional group ids (from `/etc/group` and the request).
    pub additional_gids: Vec<u32>,
}

/// Parses an image `User` string: `""`, `uid`, `name`, `uid:gid`, `name:gid`.
/// Group names are not supported (an error names them).
pub fn parse_user(user: &str) -> Result<UserRequest, RuntimeError> {
    if user.is_empty() {
        return Ok(UserRequest::Image);
    }
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let gid = match g {
        None => None,
        Some(g) => Some(
            g.parse::<u32>()
                .map_err(|_| RuntimeError::InvalidArgument {
                    field: "user".to_owned(),
                    reason: format!("group {g:?} in {user:?} is not numeric"),
                })?,
        ),
    };
    Ok(match u.parse::<u32>() {
        Ok(uid) => UserRequest::Id { uid, gid },
        Err(_) => UserRequest::Name {
            name: u.to_owned(),
            gid,
        },
    })
}

/// True when resolving `user` needs the image's `/etc/passwd`.
pub fn user_needs_lookup(user: &UserRequest) -> bool {
    matches!(
        user,
        UserRequest::Name { .. } | UserRequest::Id { gid: None, .. }
    )
}

/// Resolves a user against the contents of `/etc/passwd` and `/etc/group`
/// of the image rootfs (either may be empty when the file is missing).
pub fn resolve_user(
    user: &UserRequest,
    passwd: &str,
    group: &str,
) -> Result<ResolvedUser, RuntimeError> {
    // name:x:uid:gid:gecos:home:shell
    let entries: Vec<(&str, u32, u32)> = passwd
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 || l.starts_with('#') {
                return None;
            }
            Some((f[0], f[2].parse().ok()?, f[3].parse().ok()?))
        })
        .collect();
    let (name, uid, gid) = match user {
        UserRequest::Image => (Some("root"), 0, Some(0)),
        UserRequest::Id { uid, gid } => {
            let e = entries.iter().find(|e| e.1 == *uid);
            (e.map(|e| e.0), *uid, gid.or(e.map(|e| e.2)).or(Some(0)))
        }
        UserRequest::Name { name, gid } => {
            let e = entries.iter().find(|e| e.0 == name).ok_or_else(|| {
                RuntimeError::InvalidArgument {
                    field: "user".to_owned(),
                    reason: format!("no user {name:?} in the image's /etc/passwd"),
                }
            })?;
            (Some(e.0), e.1, gid.or(Some(e.2)))
        }
    };
    let gid = gid.unwrap_or(0);
    let mut additional = Vec::new();
    if let Some(name) = name {
        // name:x:gid:member,member
        for l in group.lines() {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 {
                continue;
            }
            let Ok(g) = f[2].parse::<u32>() else { continue };
            if f[3].split(',').any(|m| m == name) && g != gid && !additional.contains(&g) {
                additional.push(g);
            }
        }
    }
    Ok(ResolvedUser {
        uid,
        gid,
        additional_gids: additional,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str =
        "root:x:0:0:root:/root:/bin/sh\n# comment\nwww:x:33:34:www:/var/www:/bin/false\nbad line\n";
    const GROUP: &str =
        "root:x:0:\nwww:x:34:\naudio:x:29:www,other\nvideo:x:44:other\nstaff:x:50:www\n";

    #[test]
    fn user_resolution_from_passwd_and_group() {
        let u = resolve_user(&parse_user("www").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(
            u,
            ResolvedUser {
                uid: 33,
                gid: 34,
                additional_gids: vec![29, 50]
            }
        );
        let u = resolve_user(&parse_user("33").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(u.gid, 34);
        let u = resolve_user(&parse_user("33:7").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid), (33, 7));
        let u = resolve_user(&parse_user("1234").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(
            u,
            ResolvedUser {
                uid: 1234,
                gid: 0,
                additional_gids: vec![]
            }
        );
        assert!(resolve_user(&parse_user("nobody").unwrap(), PASSWD, GROUP).is_err());
        assert!(parse_user("www:staff").is_err());
        assert!(user_needs_lookup(&parse_user("www").unwrap()));
        assert!(!user_needs_lookup(&parse_user("1:2").unwrap()));
    }
}
