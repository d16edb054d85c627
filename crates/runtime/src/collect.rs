//! The runtime as a garbage collector: shims whose task containerd forgot.

use async_trait::async_trait;
use cubelet_engine::{Collector, GcReport, LiveSandboxes};

use crate::container::ContainerRuntime;

#[async_trait]
impl Collector for ContainerRuntime {
    fn name(&self) -> &'static str {
        "shims"
    }

    /// Shims are orphans by containerd's own task list, not by the store,
    /// so `live` is not asked.
    async fn collect(&self, _live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        match self.reap_orphan_shims().await {
            Ok(n) => report.add("shim", n),
            Err(e) => report.fail("shim", &e),
        }
        report
    }
}
