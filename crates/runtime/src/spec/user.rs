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
    /// An image `User` whose group is a name (`name:group` or `uid:group`):
    /// the group is resolved from the image's `/etc/group`, the user as
    /// [`UserRequest::Name`] or [`UserRequest::Id`] would be.
    NamedGroup {
        /// User name or numeric uid, as the image wrote it.
        user: String,
        /// Group name.
        group: String,
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

/// Parses an image `User` string: `""`, `uid`, `name`, `uid:gid`,
/// `name:gid`, `uid:group` or `name:group`, as Docker and containerd read it.
pub fn parse_user(user: &str) -> Result<UserRequest, RuntimeError> {
    if user.is_empty() {
        return Ok(UserRequest::Image);
    }
    let invalid = |reason: String| RuntimeError::InvalidArgument {
        field: "image user".to_owned(),
        reason,
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    if u.is_empty() || g.is_some_and(|g| g.is_empty() || g.contains(':')) {
        return Err(invalid(format!(
            "{user:?} is not user, user:group, uid or uid:gid"
        )));
    }
    let gid = match g {
        None => None,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => Some(gid),
            Err(_) => {
                return Ok(UserRequest::NamedGroup {
                    user: u.to_owned(),
                    group: g.to_owned(),
                })
            }
        },
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
        UserRequest::Name { .. }
            | UserRequest::Id { gid: None, .. }
            | UserRequest::NamedGroup { .. }
    )
}

/// The `(name, gid, members)` entries of an `/etc/group`, malformed lines
/// skipped.
fn group_entries(group: &str) -> impl Iterator<Item = (&str, u32, &str)> {
    // name:x:gid:member,member
    group.lines().filter_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() < 4 || l.starts_with('#') {
            return None;
        }
        Some((f[0], f[2].parse().ok()?, f[3]))
    })
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
    let by_name = |name: &str| {
        entries
            .iter()
            .find(|e| e.0 == name)
            .ok_or_else(|| RuntimeError::InvalidArgument {
                field: "user".to_owned(),
                reason: format!("no user {name:?} in the image's /etc/passwd"),
            })
    };
    let (name, uid, gid) = match user {
        UserRequest::Image => (Some("root"), 0, Some(0)),
        UserRequest::Id { uid, gid } => {
            let e = entries.iter().find(|e| e.1 == *uid);
            (e.map(|e| e.0), *uid, gid.or(e.map(|e| e.2)).or(Some(0)))
        }
        UserRequest::Name { name, gid } => {
            let e = by_name(name)?;
            (Some(e.0), e.1, gid.or(Some(e.2)))
        }
        UserRequest::NamedGroup { user, group: g } => {
            let gid = group_entries(group)
                .find(|e| e.0 == g)
                .map(|e| e.1)
                .ok_or_else(|| RuntimeError::InvalidArgument {
                    field: "user".to_owned(),
                    reason: format!("no group {g:?} in the image's /etc/group"),
                })?;
            match user.parse::<u32>() {
                Ok(uid) => (
                    entries.iter().find(|e| e.1 == uid).map(|e| e.0),
                    uid,
                    Some(gid),
                ),
                Err(_) => {
                    let e = by_name(user)?;
                    (Some(e.0), e.1, Some(gid))
                }
            }
        }
    };
    let gid = gid.unwrap_or(0);
    let mut additional = Vec::new();
    if let Some(name) = name {
        for (_, g, members) in group_entries(group) {
            if members.split(',').any(|m| m == name) && g != gid && !additional.contains(&g) {
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
        assert!(user_needs_lookup(&parse_user("www").unwrap()));
        assert!(!user_needs_lookup(&parse_user("1:2").unwrap()));
    }

    #[test]
    fn a_group_name_in_the_image_user_comes_from_its_etc_group() {
        // `USER www:staff`, `USER 1234:audio`: the group from /etc/group, the
        // user's other groups as for any named user.
        let u = resolve_user(&parse_user("www:staff").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(
            u,
            ResolvedUser {
                uid: 33,
                gid: 50,
                additional_gids: vec![29]
            }
        );
        let u = resolve_user(&parse_user("1234:audio").unwrap(), PASSWD, GROUP).unwrap();
        assert_eq!(
            u,
            ResolvedUser {
                uid: 1234,
                gid: 29,
                additional_gids: vec![]
            }
        );
        assert!(user_needs_lookup(&parse_user("1234:audio").unwrap()));
        // A group or user the image does not have is refused, named.
        for (user, missing) in [("www:nogroup", "nogroup"), ("nobody:staff", "nobody")] {
            let err = resolve_user(&parse_user(user).unwrap(), PASSWD, GROUP).unwrap_err();
            assert!(
                matches!(&err, RuntimeError::InvalidArgument { reason, .. } if reason.contains(missing)),
                "{user}: {err}"
            );
        }
        // Malformed: an empty part, or a third.
        for user in [":staff", "www:", "www:staff:x"] {
            assert!(parse_user(user).is_err(), "{user}");
        }
    }
}
