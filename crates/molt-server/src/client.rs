//! A minimal HTTP/1.1 client for the service's own tests and load benchmark: one request per
//! connection (`Connection: close`), `Content-Length` or chunked bodies, and server-sent
//! events read one at a time — so a test can stop reading mid-answer and hang up.
//!
//! Not a general client (no TLS, no redirects, no keep-alive); the crate's dependencies have
//! no HTTP client, and these ~200 lines avoid adding one for tests.

use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A complete response.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body bytes (de-chunked).
    pub body: Vec<u8>,
}

impl Response {
    /// The body as JSON.
    ///
    /// # Errors
    /// The body is not JSON.
    pub fn json(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
    }

    /// A header's value.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` name, if any.
    pub event: Option<String>,
    /// The `data:` lines joined by newlines.
    pub data: String,
}

impl SseEvent {
    /// The data as JSON (`None` for `[DONE]` or non-JSON data).
    #[must_use]
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.data).ok()
    }
}

struct Conn {
    reader: BufReader<TcpStream>,
    chunked: bool,
    /// Bytes left in the current chunk (chunked) or in the body (`Content-Length`).
    remaining: Option<usize>,
    done: bool,
}

async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> io::Result<(u16, Vec<(String, String)>, Conn)> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\n");
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await?;
    if let Some(b) = body {
        s.write_all(b).await?;
    }
    s.flush().await?;
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {line:?}"),
            )
        })?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "headers cut off",
            ));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let chunked = get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let remaining = if chunked {
        Some(0)
    } else {
        get("content-length").and_then(|v| v.parse().ok())
    };
    Ok((
        status,
        headers,
        Conn {
            reader,
            chunked,
            remaining,
            done: false,
        },
    ))
}

impl Conn {
    /// Appends more body bytes to `buf`; false at the end of the body.
    async fn read_more(&mut self, buf: &mut Vec<u8>) -> io::Result<bool> {
        if self.done {
            return Ok(false);
        }
        if self.chunked && self.remaining == Some(0) {
            let mut line = String::new();
            if self.reader.read_line(&mut line).await? == 0 {
                self.done = true;
                return Ok(false);
            }
            let size = line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size, 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad chunk size {line:?}"),
                )
            })?;
            if size == 0 {
                self.done = true;
                return Ok(false);
            }
            self.remaining = Some(size);
        }
        let want = self.remaining.unwrap_or(16 * 1024).min(16 * 1024);
        if want == 0 {
            self.done = true;
            return Ok(false);
        }
        let mut tmp = vec![0u8; want];
        let n = self.reader.read(&mut tmp).await?;
        if n == 0 {
            self.done = true;
            return Ok(false);
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(r) = self.remaining.as_mut() {
            *r -= n;
            if *r == 0 {
                if self.chunked {
                    let mut crlf = [0u8; 2];
                    self.reader.read_exact(&mut crlf).await?;
                } else {
                    self.done = true;
                }
            }
        }
        Ok(true)
    }
}

/// Sends one request and reads the whole response.
///
/// # Errors
/// Connection or protocol errors.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> io::Result<Response> {
    let (status, headers, mut conn) = send(addr, method, path, body).await?;
    let mut out = Vec::new();
    while conn.read_more(&mut out).await? {}
    Ok(Response {
        status,
        headers,
        body: out,
    })
}

/// Sends a JSON value with `POST` and reads the whole response.
///
/// # Errors
/// As [`request`].
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> io::Result<Response> {
    request(addr, "POST", path, Some(body.to_string().as_bytes())).await
}

/// An open event stream. Dropping it closes the connection (the server sees the client
/// leave).
pub struct EventStream {
    conn: Conn,
    buf: Vec<u8>,
    /// Status code (200).
    pub status: u16,
}

/// Posts `body` and, on a 200, returns the event stream; otherwise the whole response.
///
/// # Errors
/// Connection or protocol errors.
pub async fn stream(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> io::Result<Result<EventStream, Response>> {
    let text = body.to_string();
    let (status, headers, mut conn) = send(addr, "POST", path, Some(text.as_bytes())).await?;
    if status != 200 {
        let mut out = Vec::new();
        while conn.read_more(&mut out).await? {}
        return Ok(Err(Response {
            status,
            headers,
            body: out,
        }));
    }
    Ok(Ok(EventStream {
        conn,
        buf: Vec::new(),
        status,
    }))
}

impl EventStream {
    /// The next event (comments and keep-alives skipped); `None` at the end of the stream.
    ///
    /// # Errors
    /// Connection or protocol errors.
    pub async fn next(&mut self) -> io::Result<Option<SseEvent>> {
        loop {
            if let Some(end) = find_blank_line(&self.buf) {
                let block: Vec<u8> = self.buf.drain(..end.0).collect();
                self.buf.drain(..end.1);
                if let Some(ev) = parse_block(&String::from_utf8_lossy(&block)) {
                    return Ok(Some(ev));
                }
                continue;
            }
            if !self.conn.read_more(&mut self.buf).await? {
                return Ok(None);
            }
        }
    }
}

/// `(end of block, length of the separator)` of the first event block.
fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    for i in 0..b.len() {
        if b[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        if b[i..].starts_with(b"\n\n") {
            return Some((i, 2));
        }
    }
    None
}

fn parse_block(block: &str) -> Option<SseEvent> {
    let mut event = None;
    let mut data: Vec<&str> = Vec::new();
    for line in block.lines() {
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = Some(value.to_string()),
            "data" => data.push(value),
            _ => {}
        }
    }
    if data.is_empty() && event.is_none() {
        return None;
    }
    Some(SseEvent {
        event,
        data: data.join("\n"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_blocks_parse_and_comments_are_skipped() {
        assert_eq!(parse_block(": keep-alive"), None);
        let e = parse_block("event: x\ndata: {\"a\":1}\ndata: 2").unwrap();
        assert_eq!(e.event.as_deref(), Some("x"));
        assert_eq!(e.data, "{\"a\":1}\n2");
        assert_eq!(find_blank_line(b"data: 1\n\ndata: 2"), Some((7, 2)));
    }
}
