//! Running one CNI plugin binary: environment, config on stdin, result or
//! error object on stdout (CNI spec, "Execution Protocol").

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::Value;
use tokio::io::AsyncWriteExt;

use crate::error::NetworkError;

/// A CNI operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Add,
    Del,
    Check,
    Version,
}

impl Op {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Op::Add => "ADD",
            Op::Del => "DEL",
            Op::Check => "CHECK",
            Op::Version => "VERSION",
        }
    }
}

/// The per-call environment of a plugin.
#[derive(Debug, Clone)]
pub(crate) struct Invocation<'a> {
    pub(crate) op: Op,
    pub(crate) container_id: &'a str,
    /// Namespace path; empty when there is none (allowed for DEL).
    pub(crate) netns: &'a str,
    pub(crate) ifname: &'a str,
    /// `CNI_ARGS`, `K=V;K=V`.
    pub(crate) args: &'a str,
    /// `CNI_PATH`, colon-separated.
    pub(crate) path: &'a str,
}

/// The executable for plugin `plugin` in the first of `dirs` that has one.
pub(crate) fn find(dirs: &[PathBuf], plugin: &str) -> Result<PathBuf, NetworkError> {
    dirs.iter()
        .map(|d| d.join(plugin))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| NetworkError::CniPluginNotFound {
            plugin: plugin.to_owned(),
            dirs: join_dirs(dirs),
        })
}

/// `dirs` as a `CNI_PATH` value.
pub(crate) fn join_dirs(dirs: &[PathBuf]) -> String {
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

/// Runs `binary` (plugin type `plugin`) with `stdin` as its config. Returns
/// the JSON it printed on success (`None` when it printed nothing, as DEL and
/// CHECK do). A non-zero exit becomes [`NetworkError::CniPlugin`] carrying
/// the plugin's error object, or its stderr when it printed none.
pub(crate) async fn exec(
    binary: &Path,
    plugin: &str,
    inv: &Invocation<'_>,
    stdin: &[u8],
) -> Result<Option<Value>, NetworkError> {
    let command = inv.op.as_str();
    let exec_err = |source| NetworkError::CniExec {
        plugin: plugin.to_owned(),
        command,
        source,
    };
    let mut cmd = tokio::process::Command::new(binary);
    cmd.env("CNI_COMMAND", command)
        .env("CNI_PATH", inv.path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A dropped (cancelled) call does not leave the plugin running.
        .kill_on_drop(true);
    if inv.op == Op::Version {
        for var in ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS"] {
            cmd.env_remove(var);
        }
    } else {
        cmd.env("CNI_CONTAINERID", inv.container_id)
            .env("CNI_NETNS", inv.netns)
            .env("CNI_IFNAME", inv.ifname)
            .env("CNI_ARGS", inv.args);
    }
    let mut child = cmd.spawn().map_err(exec_err)?;
    if let Some(mut input) = child.stdin.take() {
        // A plugin that exits without reading its config closes the pipe;
        // its exit status tells what happened, so a write error is not fatal.
        let _ = input.write_all(stdin).await;
        drop(input);
    }
    let out = child.wait_with_output().await.map_err(exec_err)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stdout = stdout.trim();
    if !out.status.success() {
        return Err(plugin_error(
            plugin,
            command,
            stdout,
            &out.stderr,
            out.status,
        ));
    }
    if stdout.is_empty() {
        return Ok(None);
    }
    serde_json::from_str(stdout)
        .map(Some)
        .map_err(|e| NetworkError::CniOutput {
            plugin: plugin.to_owned(),
            command,
            reason: format!("{e}: {}", truncate(stdout)),
        })
}

/// The typed error for a failed plugin run.
fn plugin_error(
    plugin: &str,
    command: &'static str,
    stdout: &str,
    stderr: &[u8],
    status: std::process::ExitStatus,
) -> NetworkError {
    let parsed: Option<Value> = serde_json::from_str(stdout).ok();
    let field = |k: &str| {
        parsed
            .as_ref()
            .and_then(|v| v.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let code = parsed
        .as_ref()
        .and_then(|v| v.get("code"))
        .and_then(Value::as_u64)
        .and_then(|c| u32::try_from(c).ok());
    let mut msg = field("msg");
    if msg.is_empty() {
        let err = String::from_utf8_lossy(stderr);
        msg = match err.trim() {
            "" if stdout.is_empty() => format!("exited with {status}"),
            "" => truncate(stdout),
            e => truncate(e),
        };
    }
    NetworkError::CniPlugin {
        plugin: plugin.to_owned(),
        command,
        code,
        msg,
        details: field("details"),
    }
}

fn truncate(s: &str) -> String {
    const MAX: usize = 512;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(name);
        let mut f = std::fs::File::create(&path).unwrap();
        writeln!(f, "#!/bin/sh\n{body}").unwrap();
        drop(f);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn inv(op: Op) -> Invocation<'static> {
        Invocation {
            op,
            container_id: "abc",
            netns: "/run/x",
            ifname: "eth0",
            args: "IgnoreUnknown=1",
            path: "/nowhere",
        }
    }

    #[tokio::test]
    async fn env_and_stdin_reach_the_plugin_and_the_result_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let bin = script(
            dir.path(),
            "echoer",
            r#"in=$(cat); printf '{"cmd":"%s","id":"%s","ns":"%s","if":"%s","args":"%s","in":%s}' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_NETNS" "$CNI_IFNAME" "$CNI_ARGS" "$in""#,
        );
        assert_eq!(find(&[dir.path().to_path_buf()], "echoer").unwrap(), bin);
        let out = exec(&bin, "echoer", &inv(Op::Add), br#"{"x":1}"#)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(out["cmd"], "ADD");
        assert_eq!(out["id"], "abc");
        assert_eq!(out["ns"], "/run/x");
        assert_eq!(out["if"], "eth0");
        assert_eq!(out["args"], "IgnoreUnknown=1");
        assert_eq!(out["in"]["x"], 1);
    }

    #[tokio::test]
    async fn plugin_errors_are_typed_and_name_the_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let bin = script(
            dir.path(),
            "failer",
            r#"cat >/dev/null; echo '{"cniVersion":"1.0.0","code":7,"msg":"bad config","details":"no subnet"}'; exit 1"#,
        );
        let err = exec(&bin, "failer", &inv(Op::Add), b"{}")
            .await
            .unwrap_err();
        match &err {
            NetworkError::CniPlugin {
                plugin, code, msg, ..
            } => {
                assert_eq!(plugin, "failer");
                assert_eq!(*code, Some(7));
                assert_eq!(msg, "bad config");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            "cni plugin failer ADD failed (code 7): bad config: no subnet"
        );

        let bin = script(dir.path(), "crasher", "echo boom >&2; exit 3");
        let err = exec(&bin, "crasher", &inv(Op::Del), b"{}")
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("crasher DEL failed: boom"),
            "{err}"
        );

        let bin = script(dir.path(), "garbler", "echo not-json");
        let err = exec(&bin, "garbler", &inv(Op::Add), b"{}")
            .await
            .unwrap_err();
        assert!(matches!(err, NetworkError::CniOutput { .. }), "{err}");

        let bin = script(dir.path(), "quiet", "cat >/dev/null");
        assert!(exec(&bin, "quiet", &inv(Op::Del), b"{}")
            .await
            .unwrap()
            .is_none());
    }

    #[test]
    fn missing_plugins_are_reported_with_the_search_path() {
        let err = find(
            &["/nonexistent-a".into(), "/nonexistent-b".into()],
            "bridge",
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "cni plugin bridge not found in /nonexistent-a:/nonexistent-b"
        );
    }
}
