use super::*;
use std::fs;

const GIB: u64 = 1 << 30;

/// A fake `/proc` + `/sys` tree.
struct Fake {
    dir: tempfile::TempDir,
}

impl Fake {
    fn new(rss_kib: u64) -> Fake {
        let fake = Fake {
            dir: tempfile::tempdir().expect("tempdir"),
        };
        fake.write(
            "proc/self/status",
            &format!("Name:\tmolt\nVmRSS:\t{rss_kib} kB\n"),
        );
        fs::create_dir_all(fake.dir.path().join("sys")).expect("sys");
        fake
    }

    fn write(&self, rel: &str, text: &str) {
        let path = self.dir.path().join(rel);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(path, text).expect("write");
    }

    fn meminfo(&self, available_kib: u64) {
        self.write(
                "proc/meminfo",
                &format!(
                    "MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:   {available_kib} kB\n"
                ),
            );
    }

    fn source(&self) -> SystemBudget {
        SystemBudget::with_roots(SystemRoots {
            proc_root: self.dir.path().join("proc"),
            sys_root: self.dir.path().join("sys"),
        })
    }
}

fn bytes_of(source: &mut SystemBudget) -> u64 {
    source.budget(Tick::default()).expect("budget").bytes
}

#[test]
fn meminfo_only() {
    let fake = Fake::new(100 * 1024);
    fake.meminfo(4 * 1024 * 1024);
    let mut s = fake.source();
    assert_eq!(
        bytes_of(&mut s),
        4 * GIB + 100 * MIB - DEFAULT_RESERVE_BYTES
    );
    let reading = s.read().expect("read");
    assert_eq!(reading.cgroup, None);
    assert_eq!(reading.psi, None);
    assert_eq!(reading.mem_total_bytes, Some(16_000_000 * 1024));
}

#[test]
fn v2_limit_binds_when_tighter_than_meminfo() {
    let fake = Fake::new(200 * 1024);
    fake.meminfo(8 * 1024 * 1024);
    fake.write("proc/self/cgroup", "0::/app.slice/molt.scope\n");
    fake.write("sys/fs/cgroup/cgroup.controllers", "cpu memory io\n");
    let dir = "sys/fs/cgroup/app.slice/molt.scope";
    fake.write(&format!("{dir}/memory.max"), &format!("{}\n", 2 * GIB));
    fake.write(&format!("{dir}/memory.high"), "max\n");
    fake.write(&format!("{dir}/memory.current"), &format!("{GIB}\n"));
    let mut s = fake.source().with_reserve(0);
    // headroom 1 GiB + own RSS 200 MiB.
    assert_eq!(bytes_of(&mut s), GIB + 200 * MIB);
    let cg = s.read().expect("read").cgroup.expect("cgroup");
    assert_eq!(cg.version, CgroupVersion::V2);
    assert_eq!(cg.limit_bytes, Some(2 * GIB));
    assert_eq!(cg.headroom_bytes, Some(GIB));
}

#[test]
fn v2_memory_high_and_ancestors_count() {
    let fake = Fake::new(0);
    fake.meminfo(64 * 1024 * 1024);
    fake.write("proc/self/cgroup", "0::/a/b\n");
    fake.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
    // Own level: high 3 GiB below max 4 GiB, 1 GiB used -> 2 GiB headroom.
    fake.write("sys/fs/cgroup/a/b/memory.max", &format!("{}\n", 4 * GIB));
    fake.write("sys/fs/cgroup/a/b/memory.high", &format!("{}\n", 3 * GIB));
    fake.write("sys/fs/cgroup/a/b/memory.current", &format!("{GIB}\n"));
    // Parent: 5 GiB limit, 4.5 GiB used by siblings and us -> 0.5 GiB headroom binds.
    fake.write("sys/fs/cgroup/a/memory.max", &format!("{}\n", 5 * GIB));
    fake.write(
        "sys/fs/cgroup/a/memory.current",
        &format!("{}\n", 4 * GIB + GIB / 2),
    );
    let mut s = fake.source().with_reserve(0);
    assert_eq!(bytes_of(&mut s), GIB / 2);
    let cg = s.read().expect("read").cgroup.expect("cgroup");
    assert_eq!(
        cg.binding_dir.as_deref(),
        Some(fake.dir.path().join("sys/fs/cgroup/a").as_path())
    );
}

#[test]
fn v2_max_unlimited_falls_back_to_meminfo() {
    let fake = Fake::new(0);
    fake.meminfo(1024 * 1024);
    fake.write("proc/self/cgroup", "0::/x\n");
    fake.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
    fake.write("sys/fs/cgroup/x/memory.max", "max\n");
    fake.write("sys/fs/cgroup/x/memory.current", "123\n");
    let mut s = fake.source().with_reserve(0);
    assert_eq!(bytes_of(&mut s), GIB);
    let cg = s.read().expect("read").cgroup.expect("cgroup found");
    assert_eq!(cg.headroom_bytes, None);
}

#[test]
fn v1_hybrid_layout() {
    let fake = Fake::new(50 * 1024);
    fake.meminfo(32 * 1024 * 1024);
    fake.write(
        "proc/self/cgroup",
        "4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n",
    );
    // Hybrid: unified exists without a memory controller.
    fake.write("sys/fs/cgroup/unified/cgroup.controllers", "\n");
    fake.write(
        "sys/fs/cgroup/memory/memory.limit_in_bytes",
        "9223372036854771712\n",
    );
    fake.write("sys/fs/cgroup/memory/memory.usage_in_bytes", "999999\n");
    let dir = "sys/fs/cgroup/memory/process_api/abc";
    fake.write(
        &format!("{dir}/memory.limit_in_bytes"),
        &format!("{}\n", 3 * GIB),
    );
    fake.write(
        &format!("{dir}/memory.usage_in_bytes"),
        &format!("{}\n", 2 * GIB),
    );
    let mut s = fake.source().with_reserve(0);
    assert_eq!(bytes_of(&mut s), GIB + 50 * MIB);
    let cg = s.read().expect("read").cgroup.expect("cgroup");
    assert_eq!(cg.version, CgroupVersion::V1);
}

#[test]
fn namespaced_mount_resolves_to_the_mount_root() {
    let fake = Fake::new(0);
    fake.write("proc/self/cgroup", "7:memory:/docker/0123\n");
    // Inside the container the mount *is* the cgroup: the path does not exist under it.
    fake.write(
        "sys/fs/cgroup/memory/memory.limit_in_bytes",
        &format!("{GIB}\n"),
    );
    fake.write("sys/fs/cgroup/memory/memory.usage_in_bytes", "0\n");
    let mut s = fake.source().with_reserve(0);
    // No meminfo at all: the cgroup alone gives the budget.
    assert_eq!(bytes_of(&mut s), GIB);
}

#[test]
fn over_the_limit_means_only_own_usage_remains() {
    let fake = Fake::new(300 * 1024);
    fake.write("proc/self/cgroup", "0::/\n");
    fake.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
    fake.write("sys/fs/cgroup/memory.max", &format!("{GIB}\n"));
    fake.write("sys/fs/cgroup/memory.current", &format!("{}\n", 2 * GIB));
    let mut s = fake.source().with_reserve(100 * MIB);
    assert_eq!(bytes_of(&mut s), 200 * MIB);
}

#[test]
fn missing_everything_is_a_clear_error() {
    let fake = Fake::new(0);
    let mut s = fake.source();
    let err = s.budget(Tick::default()).expect_err("no info");
    assert!(matches!(err, PressureError::NoMemoryInfo { .. }), "{err}");
    fs::remove_file(fake.dir.path().join("proc/self/status")).expect("rm");
    let err = s.read().expect_err("no status");
    assert!(matches!(err, PressureError::Io { .. }), "{err}");
}

#[test]
fn malformed_limit_is_an_error_naming_the_file() {
    let fake = Fake::new(0);
    fake.meminfo(1024);
    fake.write("proc/self/cgroup", "0::/\n");
    fake.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
    fake.write("sys/fs/cgroup/memory.max", "lots\n");
    fake.write("sys/fs/cgroup/memory.current", "1\n");
    let err = fake.source().read().expect_err("bad limit");
    assert!(err.to_string().contains("memory.max"), "{err}");
}

#[test]
fn psi_drives_pressure() {
    let fake = Fake::new(0);
    fake.meminfo(1024 * 1024);
    fake.write(
            "proc/pressure/memory",
            "some avg10=42.50 avg60=1.00 avg300=0.00 total=5\nfull avg10=3.00 avg60=0.00 avg300=0.00 total=1\n",
        );
    let mut s = fake.source().with_reserve(0);
    let b = s.budget(Tick::default()).expect("budget");
    assert!((b.pressure - 0.425).abs() < 1e-9, "{}", b.pressure);
    let psi = s.read().expect("read").psi.expect("psi");
    assert!((psi.full_avg10 - 3.0).abs() < 1e-9);
    fake.write("proc/pressure/memory", "garbage\n");
    assert!(s.read().is_err());
}

#[test]
fn pressure_without_psi_is_relative_to_the_first_reading() {
    let fake = Fake::new(0);
    fake.meminfo(1024 * 1024);
    let mut s = fake.source().with_reserve(0);
    assert!(s.budget(Tick::default()).expect("b").pressure.abs() < 1e-12);
    fake.meminfo(256 * 1024);
    let b = s.budget(Tick::default()).expect("b");
    assert!((b.pressure - 0.75).abs() < 1e-9, "{}", b.pressure);
}

#[test]
fn real_system_reads() {
    let mut s = SystemBudget::new();
    let reading = s.read().expect("this machine has /proc");
    assert!(reading.own_rss_bytes > 0);
    let b = s.budget(Tick::default()).expect("budget");
    assert_eq!(b.origin, BudgetOrigin::System);
    assert!(b.bytes > 0);
    assert!(s.describe().contains("system"));
}

#[test]
fn trace_budget_replays_and_reports_pressure() {
    let trace = Trace::parse(
        r#"{"name":"t","initial":1000,"events":[{"at":5,"budget":250},{"at":9,"budget":1500}]}"#,
    )
    .expect("trace");
    let mut s = TraceBudget::new(trace);
    let at = |s: &mut TraceBudget, token_index| {
        s.budget(Tick {
            token_index,
            elapsed_ms: 0,
        })
        .expect("never fails")
    };
    assert_eq!(at(&mut s, 0).bytes, 1000 * MIB);
    assert!(at(&mut s, 0).pressure.abs() < 1e-12);
    assert_eq!(at(&mut s, 5).bytes, 250 * MIB);
    assert!((at(&mut s, 5).pressure - 0.75).abs() < 1e-12);
    assert!(
        at(&mut s, 9).pressure.abs() < 1e-12,
        "above initial clamps to 0"
    );
    assert_eq!(
        s.describe(),
        "trace t (token clock, 2 steps, initial 1000 MiB)"
    );
}

#[test]
fn fixed_budget_follows_its_handle() {
    let mut s = FixedBudget::new(800 * MIB);
    let handle = s.handle();
    let other_thread = std::thread::spawn(move || handle.set(200 * MIB));
    other_thread.join().expect("join");
    let b = s.budget(Tick::default()).expect("never fails");
    assert_eq!(b.bytes, 200 * MIB);
    assert!((b.pressure - 0.75).abs() < 1e-12);
    assert_eq!(b.origin, BudgetOrigin::Fixed);
}

#[test]
fn proc_cgroup_parsing() {
    let (v2, v1) = parse_proc_cgroup("12:memory:/m\n0::/u\n3:cpu,memory2:/no\n");
    assert_eq!(v2.as_deref(), Some("/u"));
    assert_eq!(v1.as_deref(), Some("/m"));
    assert_eq!(parse_proc_cgroup("garbage\n"), (None, None));
}
