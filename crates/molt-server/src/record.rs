//! `--record FILE`: the raw event stream of a serving run, for analysis after the fact.
//!
//! The file is one JSON document, `{"molt_record": 1, "started_unix_ms", "ladder", "events":
//! [...]}`, kept valid after every write: each record is written over the closing `]}` and
//! the closing is written again behind it, so a run that is killed still leaves a parseable
//! file, at O(1) cost per record. Every record carries `t_ms` (since the server started),
//! `unix_ms`, the request id and either a session [`Event`] verbatim (tokens with their rung
//! and latency, switches with their full cost breakdown, budget changes, the summary) or a
//! service event (`received`, `queued`, `deferred`, `admitted`, `rejected`, `disconnected`,
//! `failed`, `budget_set`).

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::ServerError;
use molt::session::Event;

/// Writes the record file; a no-op when recording is off.
pub struct Recorder {
    inner: Option<Mutex<Open>>,
    t0: Instant,
}

struct Open {
    file: File,
    /// Where the closing `]}` starts.
    tail: u64,
    first: bool,
    path: PathBuf,
    failed: bool,
}

const CLOSING: &[u8] = b"\n]}\n";

#[derive(Serialize)]
struct Line<'a, T: Serialize> {
    t_ms: f64,
    unix_ms: u64,
    request: &'a str,
    #[serde(flatten)]
    body: T,
}

#[derive(Serialize)]
struct SessionBody<'a> {
    kind: &'static str,
    event: &'a Event,
}

#[derive(Serialize)]
struct ServiceBody<'a> {
    kind: &'a str,
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    detail: serde_json::Value,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Recorder {
    /// No recording.
    #[must_use]
    pub fn off() -> Self {
        Self {
            inner: None,
            t0: Instant::now(),
        }
    }

    /// Creates (truncates) `path` and writes the header.
    ///
    /// # Errors
    /// [`ServerError::Record`] when the file cannot be written.
    pub fn create(path: &Path, header: &serde_json::Value) -> Result<Self, ServerError> {
        let wrap = |source| ServerError::Record {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::create(path).map_err(wrap)?;
        let mut head = serde_json::Map::new();
        head.insert("molt_record".into(), 1.into());
        head.insert("started_unix_ms".into(), unix_ms().into());
        if let serde_json::Value::Object(h) = header {
            head.extend(h.clone());
        }
        let mut text = serde_json::to_string(&serde_json::Value::Object(head))
            .map_err(|e| wrap(std::io::Error::other(e)))?;
        text.pop(); // the closing brace: the events array goes inside
        text.push_str(",\"events\":[");
        file.write_all(text.as_bytes()).map_err(wrap)?;
        let tail = file.stream_position().map_err(wrap)?;
        file.write_all(CLOSING).map_err(wrap)?;
        file.flush().map_err(wrap)?;
        Ok(Self {
            inner: Some(Mutex::new(Open {
                file,
                tail,
                first: true,
                path: path.to_path_buf(),
                failed: false,
            })),
            t0: Instant::now(),
        })
    }

    /// True when recording.
    #[must_use]
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// Records a session event of `request`.
    pub fn session(&self, request: &str, event: &Event) {
        if self.is_on() {
            self.write(
                request,
                SessionBody {
                    kind: "session",
                    event,
                },
            );
        }
    }

    /// Records a service event of `request` (`""` for the server itself).
    pub fn service(&self, request: &str, kind: &str, detail: serde_json::Value) {
        if self.is_on() {
            self.write(request, ServiceBody { kind, detail });
        }
    }

    fn write<T: Serialize>(&self, request: &str, body: T) {
        let Some(m) = &self.inner else { return };
        let line = Line {
            t_ms: self.t0.elapsed().as_secs_f64() * 1e3,
            unix_ms: unix_ms(),
            request,
            body,
        };
        let Ok(json) = serde_json::to_string(&line) else {
            return;
        };
        let mut o = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if o.failed {
            return;
        }
        let r = (|| -> std::io::Result<()> {
            let tail = o.tail;
            o.file.seek(SeekFrom::Start(tail))?;
            if !o.first {
                o.file.write_all(b",")?;
            }
            o.file.write_all(b"\n")?;
            o.file.write_all(json.as_bytes())?;
            o.tail = o.file.stream_position()?;
            o.file.write_all(CLOSING)?;
            o.file.flush()
        })();
        o.first = false;
        if let Err(e) = r {
            // Recording must never take the service down; say so once and stop recording.
            eprintln!("molt serve: recording to {} stopped: {e}", o.path.display());
            o.failed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_is_valid_json_after_every_record() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        let r = Recorder::create(&p, &serde_json::json!({"ladder": "tiny"})).unwrap();
        let read = || -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
        };
        assert_eq!(read()["events"].as_array().unwrap().len(), 0);
        r.service("a", "received", serde_json::json!({"stream": true}));
        r.session(
            "a",
            &Event::Stall {
                reason: "x".into(),
                deadline_ms: None,
            },
        );
        let v = read();
        assert_eq!(v["ladder"], "tiny");
        let ev = v["events"].as_array().unwrap();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0]["kind"], "received");
        assert_eq!(ev[1]["event"]["type"], "stall");
        assert!(ev[1]["t_ms"].as_f64().unwrap() >= ev[0]["t_ms"].as_f64().unwrap());
    }
}
