//! glibc malloc settings made at start, before the async runtime's threads
//! exist.
//!
//! glibc gives threads their own arenas (up to eight per core) and keeps
//! what each arena freed. The agent's live heap at 250 pods is ~12 MiB,
//! but its worker and blocking threads allocate and free the same request
//! and container buffers in different arenas: with the default the
//! anonymous RSS at 250 pods was 22 MiB, with one arena 13 MiB (docs/performance.md,
//! "Agent memory"). Small allocations stay lock-free in glibc's per-thread cache
//! either way. This is the crate's only `unsafe`: `mallopt(3)` has no safe
//! wrapper.

/// Arenas the agent asks glibc for unless the environment says otherwise.
pub const ARENAS: i32 = 1;

/// Whether the environment already chooses the arena count
/// (`MALLOC_ARENA_MAX`, or `glibc.malloc.arena_max` in `GLIBC_TUNABLES`):
/// an operator's setting wins over [`ARENAS`].
pub fn arenas_set_by(env: impl Fn(&str) -> Option<String>) -> bool {
    env("MALLOC_ARENA_MAX").is_some()
        || env("GLIBC_TUNABLES").is_some_and(|t| t.contains("glibc.malloc.arena_max"))
}

/// Limits glibc to [`ARENAS`] malloc arenas unless the environment sets
/// the count. Call it first in `main`, while the process has one thread.
/// Returns whether the limit was set (always `false` off glibc).
pub fn limit_arenas() -> bool {
    if arenas_set_by(|k| std::env::var(k).ok()) {
        return false;
    }
    set_arena_max(ARENAS)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn set_arena_max(n: i32) -> bool {
    // SAFETY: mallopt only stores the value in glibc's malloc parameters;
    // it takes no pointers and is safe to call at any time.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, n) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_arena_max(_n: i32) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_wins() {
        let none = |_: &str| None;
        assert!(!arenas_set_by(none));
        assert!(arenas_set_by(
            |k: &str| (k == "MALLOC_ARENA_MAX").then(|| "4".to_owned())
        ));
        assert!(arenas_set_by(|k: &str| (k == "GLIBC_TUNABLES").then(
            || "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=2".to_owned()
        )));
        assert!(!arenas_set_by(
            |k: &str| (k == "GLIBC_TUNABLES").then(|| "glibc.malloc.trim_threshold=0".to_owned())
        ));
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_limit() {
        assert!(set_arena_max(ARENAS));
    }
}
