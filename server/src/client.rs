//! A small blocking HTTP/1.1 client for loopback tests and the load
//! generator: one request per connection (`Connection: close`), bodies
//! by `Content-Length` or chunked, and server-sent events read as they
//! arrive. Not a general client: no TLS, no redirects, no pooling.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response's head and a reader of its body.
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Header names (lower case) and values, in order.
    pub headers: Vec<(String, String)>,
    body: Body,
}

enum Mode {
    Length(usize),
    Chunked { left: usize, done: bool },
    Close,
}

struct Body {
    r: BufReader<TcpStream>,
    mode: Mode,
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.mode {
            Mode::Close => self.r.read(buf),
            Mode::Length(left) => {
                if *left == 0 {
                    return Ok(0);
                }
                let n = (*left).min(buf.len());
                let got = self.r.read(&mut buf[..n])?;
                *left -= got;
                Ok(got)
            }
            Mode::Chunked { left, done } => {
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut line = String::new();
                    self.r.read_line(&mut line)?;
                    if line.trim().is_empty() {
                        // the CRLF after a chunk
                        line.clear();
                        self.r.read_line(&mut line)?;
                    }
                    let size = line.trim().split(';').next().unwrap_or("");
                    let n = usize::from_str_radix(size, 16).map_err(|_| {
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("bad chunk size {size:?}"),
                        )
                    })?;
                    if n == 0 {
                        *done = true;
                        return Ok(0);
                    }
                    *left = n;
                }
                let n = (*left).min(buf.len());
                let got = self.r.read(&mut buf[..n])?;
                if got == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                *left -= got;
                Ok(got)
            }
        }
    }
}

impl Response {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The whole body.
    pub fn bytes(mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        self.body.read_to_end(&mut out)?;
        Ok(out)
    }

    /// The whole body as JSON.
    pub fn json(self) -> io::Result<serde_json::Value> {
        let b = self.bytes()?;
        serde_json::from_slice(&b).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Server-sent events: each event's `data`, in order, as it arrives.
    pub fn events(self) -> Events {
        Events {
            r: BufReader::new(self.body),
        }
    }

    /// The connection, to close it early (a client that goes away).
    pub fn close(self) {
        let _ = self.body.r.get_ref().shutdown(std::net::Shutdown::Both);
    }
}

/// The `data` of server-sent events.
pub struct Events {
    r: BufReader<Body>,
}

impl Iterator for Events {
    type Item = io::Result<String>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut data = String::new();
        loop {
            let mut line = String::new();
            match self.r.read_line(&mut line) {
                Ok(0) => return (!data.is_empty()).then_some(Ok(data)),
                Ok(_) => {}
                Err(e) => return Some(Err(e)),
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if !data.is_empty() {
                    return Some(Ok(data));
                }
                continue;
            }
            if let Some(d) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
        }
    }
}

impl Events {
    /// The connection, to close it early.
    pub fn close(self) {
        let _ = self
            .r
            .into_inner()
            .r
            .get_ref()
            .shutdown(std::net::Shutdown::Both);
    }
}

/// Sends one request to `addr` (`host:port`) and reads the response head.
/// `timeout` bounds every read and write.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<Response> {
    let s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        && !body.is_empty()
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut w = &s;
    w.write_all(head.as_bytes())?;
    w.write_all(body)?;
    w.flush()?;
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {status_line:?}"),
            )
        })?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let find = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mode = if find("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        Mode::Chunked {
            left: 0,
            done: false,
        }
    } else if let Some(n) = find("content-length").and_then(|v| v.parse().ok()) {
        Mode::Length(n)
    } else {
        Mode::Close
    };
    Ok(Response {
        status,
        headers,
        body: Body { r, mode },
    })
}

/// `POST path` with a JSON body.
pub fn post_json(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
    timeout: Duration,
) -> io::Result<Response> {
    request(
        addr,
        "POST",
        path,
        headers,
        body.to_string().as_bytes(),
        timeout,
    )
}
