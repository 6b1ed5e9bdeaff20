//! The hog: a real child process that allocates and touches memory on command, so the
//! memory pressure a run meets is genuine (the kernel reclaims, PSI rises, `MemAvailable` and
//! the cgroup's usage move) rather than a number handed to the scheduler.
//!
//! - Child side: [`run_hog`] (what `molt-run hog --mib-schedule …` calls) holds a
//!   [`HogMemory`] — anonymous mappings in 1 MiB chunks, one byte written per page so every
//!   page is really resident — and moves it to each target: a [`HogSchedule`] of timed steps,
//!   overridden by lines on its control input (stdin).
//! - Parent side: [`HogChild`] spawns the child with piped stdin/stdout, steers it with
//!   [`HogChild::set_target_mib`], waits for acknowledgements, and kills and reaps it on
//!   drop, so a failed test or a panicking bench never leaks a process holding gigabytes.
//!
//! # Protocol
//!
//! Control input (parent → child), one command per line: `<mib>` sets the target; `quit`
//! exits; blank lines are ignored. Acknowledgements (child → parent): `ready` once at start,
//! `at <mib>` each time a target is reached (pages touched), `done` before exiting.
//!
//! The child exits when told `quit`, or when its control input is at end of file *and* every
//! scheduled step has been applied. So a parent that keeps the pipe open keeps the memory
//! held; a standalone hog with `stdin` from `/dev/null` follows its schedule and exits (end
//! the schedule with a step to the size to hold until then).

use super::footprint::page_size;
use std::ffi::OsStr;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::str::FromStr;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{Clock, HogError, MIB, Trace};

/// One timed step of a [`HogSchedule`]: from `at_ms` after start, hold `mib` MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HogStep {
    /// Milliseconds after the hog started.
    pub at_ms: u64,
    /// Target size in MiB.
    pub mib: u64,
}

/// Timed targets for the hog, strictly increasing in time. Written on a command line as
/// `at_ms:mib` pairs separated by commas (`0:256,2000:1024,5000:0`); a bare number is a step
/// at 0 ms. The empty schedule (`""`) holds nothing until told otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HogSchedule {
    steps: Vec<HogStep>,
}

impl HogSchedule {
    /// Builds a schedule.
    ///
    /// # Errors
    ///
    /// [`HogError::Schedule`] if the steps are not strictly increasing in `at_ms`.
    pub fn new(steps: Vec<HogStep>) -> Result<HogSchedule, HogError> {
        if let Some(w) = steps.windows(2).find(|w| w[1].at_ms <= w[0].at_ms) {
            return Err(HogError::Schedule {
                text: HogSchedule {
                    steps: steps.clone(),
                }
                .to_string(),
                reason: format!(
                    "step at {} ms does not come after the step at {} ms",
                    w[1].at_ms, w[0].at_ms
                ),
            });
        }
        Ok(HogSchedule { steps })
    }

    /// The steps.
    #[must_use]
    pub fn steps(&self) -> &[HogStep] {
        &self.steps
    }

    /// The hog schedule that leaves Molt the budget an `ms`-clock trace describes, under a
    /// ceiling (the memory there is to share, e.g. the cgroup limit): at each step the hog
    /// holds `ceiling − budget` (0 when the budget exceeds the ceiling), rounded up to MiB.
    ///
    /// # Errors
    ///
    /// [`HogError::Schedule`] for a token-clock trace: the hog cannot see tokens, so the
    /// parent must steer it with [`HogChild::set_target_mib`] instead.
    pub fn complement_of(trace: &Trace, ceiling_bytes: u64) -> Result<HogSchedule, HogError> {
        if trace.clock != Clock::Ms {
            return Err(HogError::Schedule {
                text: trace.name.clone(),
                reason: "a token-clock trace cannot drive the hog on its own; steer it \
                         with set_target_mib from the token loop"
                    .to_owned(),
            });
        }
        let mib = |budget: u64| ceiling_bytes.saturating_sub(budget).div_ceil(MIB);
        let mut steps = vec![HogStep {
            at_ms: 0,
            mib: mib(trace.initial_bytes),
        }];
        for s in &trace.steps {
            if s.at == 0 {
                steps[0].mib = mib(s.budget_bytes);
            } else {
                steps.push(HogStep {
                    at_ms: s.at,
                    mib: mib(s.budget_bytes),
                });
            }
        }
        HogSchedule::new(steps)
    }
}

impl fmt::Display for HogSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.steps.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}:{}", s.at_ms, s.mib)?;
        }
        Ok(())
    }
}

impl FromStr for HogSchedule {
    type Err = HogError;

    fn from_str(text: &str) -> Result<HogSchedule, HogError> {
        let bad = |reason: String| HogError::Schedule {
            text: text.to_owned(),
            reason,
        };
        let mut steps = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (at, mib) = item.split_once(':').unwrap_or(("0", item));
            let at_ms = at
                .trim()
                .parse()
                .map_err(|_| bad(format!("{at:?} is not a whole number of milliseconds")))?;
            let mib = mib
                .trim()
                .parse()
                .map_err(|_| bad(format!("{mib:?} is not a whole number of MiB")))?;
            steps.push(HogStep { at_ms, mib });
        }
        HogSchedule::new(steps).map_err(|e| match e {
            HogError::Schedule { reason, .. } => bad(reason),
            other => other,
        })
    }
}

/// Chunk size of [`HogMemory`]: small enough to follow a target closely, large enough that
/// 16 GiB is 16 384 mappings (far below `vm.max_map_count`).
const CHUNK_BYTES: usize = 1 << 20;

/// Resident anonymous memory of a chosen size, held in 1 MiB mappings. Growing maps new
/// chunks and writes one byte to every page of them (so the kernel must back them with real
/// frames); shrinking unmaps chunks, which returns their pages at once — unlike `free`,
/// which may keep them in the allocator.
#[derive(Debug, Default)]
pub struct HogMemory {
    chunks: Vec<memmap2::MmapMut>,
}

impl HogMemory {
    /// Holds nothing.
    #[must_use]
    pub fn new() -> HogMemory {
        HogMemory::default()
    }

    /// MiB currently held.
    #[must_use]
    pub fn mib(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// Grows or shrinks to `mib` MiB, touching every new page.
    ///
    /// # Errors
    ///
    /// [`HogError::Alloc`] if a mapping fails (what is already held stays held).
    pub fn resize_mib(&mut self, mib: u64) -> Result<(), HogError> {
        let target = usize::try_from(mib).unwrap_or(usize::MAX);
        self.chunks.truncate(target);
        let page = page_size();
        while self.chunks.len() < target {
            let mut chunk =
                memmap2::MmapMut::map_anon(CHUNK_BYTES).map_err(|source| HogError::Alloc {
                    mib,
                    held_mib: self.mib(),
                    source,
                })?;
            let base = chunk.as_mut_ptr();
            for offset in (0..CHUNK_BYTES).step_by(page) {
                // SAFETY: offset < CHUNK_BYTES, the length of the live mapping at `base`;
                // the write is volatile so the otherwise unread store is not optimised away.
                unsafe { base.add(offset).write_volatile(1) };
            }
            self.chunks.push(chunk);
        }
        Ok(())
    }
}

/// What a hog run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HogReport {
    /// Largest size held, MiB.
    pub peak_mib: u64,
    /// Targets reached (scheduled and commanded).
    pub targets_reached: u64,
}

/// The hog's main loop, acknowledging on standard output. See [`run_hog_with`].
///
/// # Errors
///
/// As [`run_hog_with`].
pub fn run_hog<R: Read + Send + 'static>(
    schedule: &HogSchedule,
    control: R,
) -> Result<HogReport, HogError> {
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    run_hog_with(schedule, control, &mut lock)
}

/// The hog's main loop: follows `schedule` and the commands on `control` (see the module
/// docs for the protocol), writing acknowledgements to `ack`. Memory is released when it
/// returns.
///
/// `control` is read on a helper thread so that scheduled steps fire on time while no
/// command arrives; hence `Send + 'static`.
///
/// # Errors
///
/// [`HogError::Protocol`] for a bad control line, [`HogError::Alloc`] when memory cannot be
/// mapped, [`HogError::Pipe`] when reading control or writing acknowledgements fails.
pub fn run_hog_with<R: Read + Send + 'static, W: Write>(
    schedule: &HogSchedule,
    control: R,
    ack: &mut W,
) -> Result<HogReport, HogError> {
    let (tx, rx) = mpsc::channel();
    // Detached on purpose: if the loop ends (quit, error) while the reader is blocked in
    // read(2), joining would hang; the thread ends with the process or at end of input.
    thread::spawn(move || {
        for line in BufReader::new(control).lines() {
            let stop = line.is_err();
            if tx.send(line).is_err() || stop {
                break;
            }
        }
    });

    let pipe = |source| HogError::Pipe { source };
    let say = |ack: &mut W, text: &str| -> Result<(), HogError> {
        writeln!(ack, "{text}").map_err(pipe)?;
        ack.flush().map_err(pipe)
    };

    let start = Instant::now();
    let steps = schedule.steps();
    let mut memory = HogMemory::new();
    let mut report = HogReport::default();
    let mut next = 0usize;
    let mut line_no = 0usize;
    let mut control_open = true;
    say(ack, "ready")?;

    let mut reach = |memory: &mut HogMemory, ack: &mut W, mib: u64| -> Result<(), HogError> {
        memory.resize_mib(mib)?;
        if crate::fault::hit(crate::fault::Site::HogExit) {
            eprintln!(
                "molt hog: {}",
                crate::fault::detail(crate::fault::Site::HogExit)
            );
            crate::fault::kill_self();
        }
        report.peak_mib = report.peak_mib.max(mib);
        report.targets_reached += 1;
        say(ack, &format!("at {mib}"))
    };

    loop {
        let elapsed = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let mut due = None;
        while next < steps.len() && steps[next].at_ms <= elapsed {
            due = Some(steps[next].mib);
            next += 1;
        }
        if let Some(mib) = due {
            reach(&mut memory, ack, mib)?;
        }
        let until_next = steps
            .get(next)
            .map(|s| Duration::from_millis(s.at_ms.saturating_sub(elapsed)));
        if !control_open {
            match until_next {
                Some(wait) => {
                    thread::sleep(wait);
                    continue;
                }
                None => break,
            }
        }
        let received = match until_next {
            Some(wait) => rx.recv_timeout(wait),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match received {
            Ok(Ok(line)) => {
                line_no += 1;
                let text = line.trim();
                if text.is_empty() {
                    continue;
                }
                if text == "quit" {
                    break;
                }
                let mib = text.parse::<u64>().map_err(|_| HogError::Protocol {
                    line_no,
                    text: text.to_owned(),
                })?;
                reach(&mut memory, ack, mib)?;
            }
            Ok(Err(source)) => return Err(HogError::Pipe { source }),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => control_open = false,
        }
    }
    drop(memory);
    say(ack, "done")?;
    Ok(report)
}

/// Parent-side handle of a running hog process. Dropping it kills and reaps the child.
#[derive(Debug)]
pub struct HogChild {
    child: Child,
    stdin: Option<ChildStdin>,
    acks: Receiver<String>,
    target_mib: Option<u64>,
}

/// How long [`HogChild::spawn`] waits for the child's `ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

impl HogChild {
    /// Starts `program args…` (e.g. `molt-run hog --mib-schedule 0:0`) with piped stdin and
    /// stdout, and waits for its `ready`.
    ///
    /// # Errors
    ///
    /// [`HogError::Spawn`] if the program cannot start; [`HogError::Exited`] or
    /// [`HogError::Timeout`] if it never says `ready`.
    pub fn spawn<I, S>(program: &Path, args: I) -> Result<HogChild, HogError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| HogError::Spawn {
                program: program.to_path_buf(),
                source,
            })?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let (tx, acks) = mpsc::channel();
        if let Some(stdout) = stdout {
            thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        let mut hog = HogChild {
            child,
            stdin,
            acks,
            target_mib: None,
        };
        hog.wait_for("ready", READY_TIMEOUT)?;
        Ok(hog)
    }

    /// The child's process id (for `/proc/<pid>/status`).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last target sent.
    #[must_use]
    pub fn target_mib(&self) -> Option<u64> {
        self.target_mib
    }

    /// Tells the child to hold `mib` MiB. Returns at once; see
    /// [`HogChild::wait_for_target`].
    ///
    /// # Errors
    ///
    /// [`HogError::Pipe`] if the child's stdin is closed (it exited).
    pub fn set_target_mib(&mut self, mib: u64) -> Result<(), HogError> {
        let pipe = |source| HogError::Pipe { source };
        let stdin = self.stdin.as_mut().ok_or_else(|| HogError::Pipe {
            source: std::io::Error::from(std::io::ErrorKind::BrokenPipe),
        })?;
        writeln!(stdin, "{mib}").map_err(pipe)?;
        stdin.flush().map_err(pipe)?;
        self.target_mib = Some(mib);
        Ok(())
    }

    /// Waits until the child reports holding `mib` MiB (all pages touched).
    ///
    /// # Errors
    ///
    /// [`HogError::Timeout`] after `timeout`; [`HogError::Exited`] if the child ends first.
    pub fn wait_for_target(&mut self, mib: u64, timeout: Duration) -> Result<(), HogError> {
        self.wait_for(&format!("at {mib}"), timeout)
    }

    /// [`HogChild::set_target_mib`] then [`HogChild::wait_for_target`].
    ///
    /// # Errors
    ///
    /// As the two.
    pub fn set_target_mib_and_wait(&mut self, mib: u64, timeout: Duration) -> Result<(), HogError> {
        self.set_target_mib(mib)?;
        self.wait_for_target(mib, timeout)
    }

    /// The child's resident set in bytes, from `/proc/<pid>/status`.
    ///
    /// # Errors
    ///
    /// [`super::PressureError::Io`] if the process is gone.
    pub fn rss_bytes(&self) -> Result<u64, super::PressureError> {
        super::footprint::rss_bytes_in(
            &Path::new("/proc")
                .join(self.pid().to_string())
                .join("status"),
        )
    }

    /// Asks the child to quit, closes its input and waits for it.
    ///
    /// # Errors
    ///
    /// [`HogError::Pipe`] if waiting fails.
    pub fn shutdown(mut self) -> Result<ExitStatus, HogError> {
        if let Some(mut stdin) = self.stdin.take() {
            // The child may already have exited; a broken pipe here is not an error.
            let _ = writeln!(stdin, "quit");
        }
        self.child
            .wait()
            .map_err(|source| HogError::Pipe { source })
    }

    fn wait_for(&mut self, expected: &str, timeout: Duration) -> Result<(), HogError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.acks.recv_timeout(left) {
                Ok(line) if line.trim() == expected => return Ok(()),
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    return Err(HogError::Timeout {
                        expected: expected.to_owned(),
                        waited_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = match self.child.wait() {
                        Ok(s) => s.to_string(),
                        Err(e) => e.to_string(),
                    };
                    return Err(HogError::Exited {
                        expected: expected.to_owned(),
                        status,
                    });
                }
            }
        }
    }
}

impl Drop for HogChild {
    fn drop(&mut self) {
        drop(self.stdin.take());
        // Already-exited children make kill fail with InvalidInput; wait still reaps them.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn schedule_round_trips_and_validates() {
        let s: HogSchedule = "0:256, 2000:1024,5000:0".parse().expect("valid");
        assert_eq!(s.steps().len(), 3);
        assert_eq!(s.to_string(), "0:256,2000:1024,5000:0");
        assert_eq!(s.to_string().parse::<HogSchedule>().expect("again"), s);
        let bare: HogSchedule = "64".parse().expect("bare");
        assert_eq!(bare.steps(), &[HogStep { at_ms: 0, mib: 64 }]);
        assert!("".parse::<HogSchedule>().expect("empty").steps().is_empty());
        for bad in ["5:1,5:2", "10:1,3:1", "x:1", "1:y", "1:-3"] {
            assert!(bad.parse::<HogSchedule>().is_err(), "{bad}");
        }
    }

    #[test]
    fn complement_of_ms_trace() {
        let trace = Trace::parse(
            r#"{"name":"m","clock":"ms","initial":1000,"events":[{"at":0,"budget":900},{"at":50,"budget":300},{"at":90,"budget":2000}]}"#,
        )
        .expect("trace");
        let s = HogSchedule::complement_of(&trace, 1000 * MIB).expect("ms trace");
        assert_eq!(s.to_string(), "0:100,50:700,90:0");
        let token = Trace::steady("t", MIB);
        assert!(HogSchedule::complement_of(&token, MIB).is_err());
    }

    #[test]
    fn run_hog_follows_commands_and_acknowledges() {
        let control = Cursor::new(b"16\n\n32\n8\nquit\n999999999\n".to_vec());
        let mut ack = Vec::new();
        let report = run_hog_with(&HogSchedule::default(), control, &mut ack).expect("runs");
        assert_eq!(
            String::from_utf8(ack).expect("utf8"),
            "ready\nat 16\nat 32\nat 8\ndone\n"
        );
        assert_eq!(report.peak_mib, 32);
        assert_eq!(report.targets_reached, 3);
    }

    #[test]
    fn run_hog_applies_schedule_after_control_closes() {
        let schedule: HogSchedule = "0:4,30:12,60:0".parse().expect("schedule");
        let mut ack = Vec::new();
        let started = Instant::now();
        let report = run_hog_with(&schedule, Cursor::new(Vec::new()), &mut ack).expect("runs");
        assert!(started.elapsed() >= Duration::from_millis(60));
        assert_eq!(
            String::from_utf8(ack).expect("utf8"),
            "ready\nat 4\nat 12\nat 0\ndone\n"
        );
        assert_eq!(report.peak_mib, 12);
    }

    #[test]
    fn run_hog_rejects_bad_lines_with_their_number() {
        let err = run_hog_with(
            &HogSchedule::default(),
            Cursor::new(b"1\n\nlots\n".to_vec()),
            &mut Vec::new(),
        )
        .expect_err("bad line");
        match err {
            HogError::Protocol { line_no, text } => {
                assert_eq!(line_no, 3);
                assert_eq!(text, "lots");
            }
            other => panic!("expected Protocol, got {other:?}"),
        }
    }
}
