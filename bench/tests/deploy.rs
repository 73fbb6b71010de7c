//! The container image's Kubernetes manifests (`deploy/k8s/`) against Kubernetes' own schemas,
//! with `kubernetes-validate` from PyPI (its schemas bundled: no cluster, no network once
//! installed). The training operator's kinds (PyTorchJob, TrainJob) have no schema there:
//! their pod templates are checked as the Pods the operator makes from them, and their own
//! fields against what the operator requires. Prints SKIPPED, and passes, where the tool cannot
//! be installed.
#![allow(clippy::unwrap_used)] // a test fails loudly on anything unexpected

use std::path::Path;
use std::process::Command;

/// Validates every document of the files it is given; prints one line per document checked.
const CHECK: &str = r#"
import sys, yaml, kubernetes_validate
from kubernetes_validate.utils import latest_version

version = latest_version()

def pod(name, spec):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

for path in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(path)):
        if doc is None:
            continue
        kind, name = doc["kind"], doc["metadata"]["name"]
        checks = []
        if kind == "PyTorchJob":
            assert doc["apiVersion"] == "kubeflow.org/v1", path
            specs = doc["spec"]["pytorchReplicaSpecs"]
            assert set(specs) <= {"Master", "Worker"} and "Master" in specs, f"{path}: replica types {list(specs)}"
            for role, r in specs.items():
                assert r["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode"), f"{path}: {role}"
                assert isinstance(r["replicas"], int) and r["replicas"] >= 1, f"{path}: {role}"
                cs = r["template"]["spec"]["containers"]
                assert any(c["name"] == "pytorch" for c in cs), f"{path}: {role} has no container named pytorch"
                checks.append(pod(f"{name}-{role.lower()}", r["template"]["spec"]))
        elif kind == "TrainJob":
            assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1", path
            assert doc["spec"]["runtimeRef"]["name"], path
            t = doc["spec"]["trainer"]
            assert isinstance(t["numNodes"], int) and t["numNodes"] >= 1, path
            node = {k: t[k] for k in ("image", "command", "args", "env") if k in t}
            node["name"] = "node"
            if "resourcesPerNode" in t:
                node["resources"] = t["resourcesPerNode"]
            checks.append(pod(f"{name}-node", {"containers": [node]}))
        else:
            checks.append(doc)
        for d in checks:
            kubernetes_validate.validate(d, version, strict=True)
            print(f"valid under Kubernetes {version}: {path}: {d['kind']} {d['metadata']['name']}")
"#;

#[test]
fn the_kubernetes_manifests_validate_against_kubernetes_schemas() {
    let python = match gradsync_testkit::kubernetes_validate_python() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIPPED: kubernetes-validate is not available here: {e}");
            return;
        }
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert_eq!(files.len(), 3, "{files:?}");
    let o = Command::new(python).arg("-c").arg(CHECK).args(&files).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    eprint!("{out}");
    for kind in [
        "Service",
        "StatefulSet",
        "Job",
        "Pod gradsync-ddp-master",
        "Pod gradsync-ddp-worker",
        "Pod gradsync-ddp-node",
    ] {
        assert!(out.contains(kind), "{kind} was not checked:\n{out}");
    }

    // A manifest that breaks the schema is refused: the check is not vacuous.
    let bad = gradsync_testkit::Scratch::new("deploy-bad");
    let text = std::fs::read_to_string(dir.join("ps.yaml")).unwrap().replace("replicas: 2", "replicas: two");
    std::fs::write(bad.join("ps.yaml"), text).unwrap();
    let python = gradsync_testkit::kubernetes_validate_python().unwrap();
    let o = Command::new(python).arg("-c").arg(CHECK).arg(bad.join("ps.yaml")).output().unwrap();
    assert!(!o.status.success(), "a StatefulSet with `replicas: two` passed");
}
