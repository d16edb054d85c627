//! The network providers as garbage collectors (namespace pins, veths,
//! leases, host-port rules, CNI attachments).

use async_trait::async_trait;
use cubelet_engine::{Collector, GcReport, LiveSandboxes};

use crate::{BridgeNetwork, CniNetwork, NoneNetwork};

#[async_trait]
impl Collector for BridgeNetwork {
    fn name(&self) -> &'static str {
        "network"
    }

    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        match self.gc(live).await {
            Ok(r) => {
                report.add("netns", r.netns);
                report.add("veth", r.veths);
                report.add("lease", r.leases);
                report.add("port_rule", r.port_rules);
            }
            Err(e) => report.fail("network", &e),
        }
        report
    }
}

#[async_trait]
impl Collector for CniNetwork {
    fn name(&self) -> &'static str {
        "network"
    }

    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        match self.gc(live).await {
            Ok(r) => {
                report.add("cni_attachment", r.attachments);
                report.add("netns", r.netns);
                if r.failed > 0 {
                    report.failures.push((
                        "network",
                        format!(
                            "CNI DEL failed for {} dead sandboxes; retried next pass",
                            r.failed
                        ),
                    ));
                }
            }
            Err(e) => report.fail("network", &e),
        }
        report
    }
}

#[async_trait]
impl Collector for NoneNetwork {
    fn name(&self) -> &'static str {
        "network"
    }

    async fn collect(&self, live: &dyn LiveSandboxes) -> GcReport {
        let mut report = GcReport::default();
        match self.gc(live).await {
            Ok(r) => report.add("netns", r.netns),
            Err(e) => report.fail("network", &e),
        }
        report
    }
}
