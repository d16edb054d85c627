//! Container records as CRI shows them: one `ContainerStatus` builder for
//! ContainerStatus and the events stream, and the ListContainers item.

use std::collections::{BTreeMap, HashMap};

use cubelet_cri_api::v1 as cri;
use cubelet_pod::{ContainerRecord, ContainerState};
use cubelet_runtime::spec::{MountSpec, Propagation};

use super::nanos;

/// A record's state in CRI terms.
pub fn container_state(s: ContainerState) -> cri::ContainerState {
    match s {
        ContainerState::Created => cri::ContainerState::ContainerCreated,
        ContainerState::Running => cri::ContainerState::ContainerRunning,
        ContainerState::Exited => cri::ContainerState::ContainerExited,
        ContainerState::Unknown => cri::ContainerState::ContainerUnknown,
    }
}

fn hash(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn propagation(p: Propagation) -> cri::MountPropagation {
    match p {
        Propagation::Private => cri::MountPropagation::PropagationPrivate,
        Propagation::HostToContainer => cri::MountPropagation::PropagationHostToContainer,
        Propagation::Bidirectional => cri::MountPropagation::PropagationBidirectional,
    }
}

/// `(reason, message)` of a container: its own reason if it has one
/// (`OOMKilled`, `StartError`), else `Completed` or `Error` once exited.
fn reason(c: &ContainerRecord) -> (String, String) {
    match (c.state, c.exit_code, &c.reason) {
        (_, _, Some(reason)) => (reason.clone(), c.message.clone().unwrap_or_default()),
        (ContainerState::Exited, Some(0), None) => ("Completed".to_owned(), String::new()),
        (ContainerState::Exited, _, None) => ("Error".to_owned(), String::new()),
        _ => (String::new(), String::new()),
    }
}

/// Linux's standard signals by number (x86 and arm numbering), for an
/// image that names its stop signal by number.
const SIGNALS: [&str; 31] = [
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGILL",
    "SIGTRAP",
    "SIGABRT",
    "SIGBUS",
    "SIGFPE",
    "SIGKILL",
    "SIGUSR1",
    "SIGSEGV",
    "SIGUSR2",
    "SIGPIPE",
    "SIGALRM",
    "SIGTERM",
    "SIGSTKFLT",
    "SIGCHLD",
    "SIGCONT",
    "SIGSTOP",
    "SIGTSTP",
    "SIGTTIN",
    "SIGTTOU",
    "SIGURG",
    "SIGXCPU",
    "SIGXFSZ",
    "SIGVTALRM",
    "SIGPROF",
    "SIGWINCH",
    "SIGIO",
    "SIGPWR",
    "SIGSYS",
];

/// `ContainerStatus.stop_signal`: the signal the runtime stops the
/// container with, from the record's `stop_signal` (the requested signal,
/// else the image's; null: neither, so SIGTERM). A record from before the
/// key existed, or a name CRI has no value for, reports the runtime default.
pub(crate) fn status_stop_signal(config: &serde_json::Value) -> cri::Signal {
    let name = match config.get("stop_signal") {
        None => return cri::Signal::RuntimeDefault,
        Some(serde_json::Value::Null) => return cri::Signal::Sigterm,
        Some(v) => v.as_str().unwrap_or_default().trim().to_ascii_uppercase(),
    };
    let name = match name.parse::<usize>() {
        Ok(n) => n
            .checked_sub(1)
            .and_then(|i| SIGNALS.get(i))
            .map_or(String::new(), |s| (*s).to_owned()),
        Err(_) if name.starts_with("SIG") => name,
        Err(_) => format!("SIG{name}"),
    };
    cri::Signal::from_str_name(&name).unwrap_or(cri::Signal::RuntimeDefault)
}

/// The CRI status of a container record.
pub fn container_status(c: &ContainerRecord) -> cri::ContainerStatus {
    let (reason, message) = reason(c);
    let mounts: Vec<MountSpec> = c
        .config
        .get("mounts")
        .and_then(|m| serde_json::from_value(m.clone()).ok())
        .unwrap_or_default();
    cri::ContainerStatus {
        id: c.id.clone(),
        metadata: Some(cri::ContainerMetadata {
            name: c.name.clone(),
            attempt: c.attempt,
        }),
        state: container_state(c.state) as i32,
        created_at: nanos(c.created_at),
        started_at: c.started_at.map_or(0, nanos),
        finished_at: c.finished_at.map_or(0, nanos),
        exit_code: c.exit_code.unwrap_or(0),
        image: Some(cri::ImageSpec {
            image: c.image.clone(),
            ..Default::default()
        }),
        image_ref: c
            .config
            .get("image_repo_digest")
            .and_then(|v| v.as_str())
            .map_or_else(|| c.image_ref.clone(), str::to_owned),
        reason,
        message,
        labels: hash(&c.labels),
        annotations: hash(&c.annotations),
        mounts: mounts
            .iter()
            .map(|m| cri::Mount {
                container_path: m.container_path.display().to_string(),
                host_path: m.host_path.display().to_string(),
                readonly: m.readonly,
                propagation: propagation(m.propagation) as i32,
                ..Default::default()
            })
            .collect(),
        log_path: c
            .log_path
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        resources: None,
        image_id: c.image_ref.clone(),
        user: None,
        stop_signal: status_stop_signal(&c.config) as i32,
    }
}

/// A container record as ListContainers shows it.
pub fn container(c: &ContainerRecord) -> cri::Container {
    cri::Container {
        id: c.id.clone(),
        pod_sandbox_id: c.sandbox_id.to_string(),
        metadata: Some(cri::ContainerMetadata {
            name: c.name.clone(),
            attempt: c.attempt,
        }),
        image: Some(cri::ImageSpec {
            image: c.image.clone(),
            ..Default::default()
        }),
        image_ref: c.image_ref.clone(),
        state: container_state(c.state) as i32,
        created_at: nanos(c.created_at),
        labels: hash(&c.labels),
        annotations: hash(&c.annotations),
        image_id: c.image_ref.clone(),
    }
}

/// Whether a record passes a ListContainers filter.
pub fn container_matches(f: &cri::ContainerFilter, c: &ContainerRecord) -> bool {
    (f.id.is_empty() || c.id.starts_with(&f.id))
        && (f.pod_sandbox_id.is_empty() || c.sandbox_id.as_str().starts_with(&f.pod_sandbox_id))
        && f.state
            .as_ref()
            .is_none_or(|s| container_state(c.state) as i32 == s.state)
        && super::labels_match(&f.label_selector, &c.labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubelet_engine::SandboxId;

    #[test]
    fn status_reasons() {
        let mut c = ContainerRecord::new("c1", SandboxId::new_unchecked("s1"), "app", 0, "busybox");
        assert_eq!(
            container_status(&c).state,
            cri::ContainerState::ContainerCreated as i32
        );
        c.state = ContainerState::Exited;
        c.exit_code = Some(0);
        assert_eq!(container_status(&c).reason, "Completed");
        c.exit_code = Some(1);
        assert_eq!(container_status(&c).reason, "Error");
        c.reason = Some("OOMKilled".into());
        assert_eq!(container_status(&c).reason, "OOMKilled");
    }

    #[test]
    fn repo_digest_and_mounts_show_in_the_status() {
        let mut c = ContainerRecord::new("c1", SandboxId::new_unchecked("s1"), "app", 0, "busybox");
        c.image_ref = "sha256:abc".into();
        c.config = serde_json::json!({
            "mounts": [{"host_path": "/h", "container_path": "/c", "readonly": true, "propagation": "Private"}],
            "image_repo_digest": "r/busybox@sha256:def",
        });
        let s = container_status(&c);
        assert_eq!(s.image_ref, "r/busybox@sha256:def");
        assert_eq!(s.image_id, "sha256:abc");
        assert_eq!(s.mounts.len(), 1);
        assert!(s.mounts[0].readonly);
    }

    #[test]
    fn stop_signal_shows_in_the_status() {
        let mut c = ContainerRecord::new("c1", SandboxId::new_unchecked("s1"), "app", 0, "busybox");
        let signal = |c: &ContainerRecord| container_status(c).stop_signal;
        // A record from before stop signals were recorded.
        assert_eq!(signal(&c), cri::Signal::RuntimeDefault as i32);
        c.config = serde_json::json!({ "stop_signal": null });
        assert_eq!(signal(&c), cri::Signal::Sigterm as i32);
        c.config = serde_json::json!({ "stop_signal": "SIGUSR1" });
        assert_eq!(signal(&c), cri::Signal::Sigusr1 as i32);
        // Images name signals loosely: "quit", "3".
        c.config = serde_json::json!({ "stop_signal": "quit" });
        assert_eq!(signal(&c), cri::Signal::Sigquit as i32);
        c.config = serde_json::json!({ "stop_signal": "3" });
        assert_eq!(signal(&c), cri::Signal::Sigquit as i32);
        c.config = serde_json::json!({ "stop_signal": "SIGRTMIN+3" });
        assert_eq!(signal(&c), cri::Signal::RuntimeDefault as i32);
    }
}
