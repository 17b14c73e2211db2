// edgepipe browser worker: this tab holds one stage of the pipeline and runs it with
// onnxruntime-web: on WebGPU when the browser gives an adapter (the package's own weight variant,
// MatMulNBits), on WebAssembly otherwise (the fp32 variant). It speaks the wire protocol of docs/protocol.md over one
// WebSocket to the coordinator (/v1/worker). A tab cannot accept connections, so it says
// kind "browser" in its hello: the coordinator relays activations to it, and it sends its own
// outputs back over the same socket (`forward` with `relay_to`, or `token` from the head).
// The native worker it mirrors: edgepipe/worker/core.py (a stage's decisions, frame by frame),
// edgepipe/worker/shell.py (its I/O) and edgepipe/runtime/stage_runner.py (the stage itself).
// The protocol's constants (version, message types, field names, error codes, limits) are not
// written here: protocol.js, generated from edgepipe/net/messages.py by
// `python -m edgepipe.net.protocol_js --write`, defines them and worker.html loads it first.
/* global ort, MessagePack, EdgepipeProtocol */
"use strict";

(() => {
  const P = self.EdgepipeProtocol;
  if (!P) throw new Error("protocol.js is not loaded: worker.html loads it before worker.js");
  const PROTOCOL = P.VERSION, T = P.MESSAGE, CODE = P.ERROR, LIMITS = P.LIMITS;
  const FIELDS = Object.fromEntries(Object.entries(P.FIELDS).map(([type, names]) => [type, new Set(names)]));
  const KV_BLOCK = 256; // KV capacity grows in blocks of this many positions (as stage_runner.py: the tab's own choice, not the wire's)
  // onnxruntime-web 1.30 runs GroupQueryAttention with a FlashAttention prefill shader once a run carries
  // 32 or more new positions; on SwiftShader (4-wide subgroups) that shader computes full-attention layers
  // wrong, for every family (docs/families.md). Under 32 it takes the shader decode steps take, which is
  // right. On an adapter that may get it wrong (prefillChunking) a longer run goes as chunks of this many.
  const WEBGPU_PREFILL_CHUNK = 31;
  const TRUSTED_SUBGROUP = 16; // the smallest subgroup size the prefill shader is left to (hardware adapters: not checked here)
  const ARRAYS = { float32: [Float32Array, 4], float16: [Uint16Array, 2], int64: [BigInt64Array, 8],
                   int32: [Int32Array, 4], uint8: [Uint8Array, 1], bool: [Uint8Array, 1] };
  const DTYPES = Object.fromEntries(P.DTYPES.map((d) => {
    if (!ARRAYS[d]) throw new Error(`the protocol allows dtype ${d}, which this worker cannot read`);
    return [d, ARRAYS[d]];
  }));
  const params = new URLSearchParams(location.search);

  // -- page ------------------------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);
  const stats = { computed: 0, tokens: 0, hits: 0, fetched: 0, held: 0, heldBytes: 0, busy_s: 0 };
  function show(state, message) {
    document.body.dataset.state = state;
    $("state").textContent = state;
    if (message !== undefined) $("message").textContent = message;
  }
  function log(line) {
    const el = $("log");
    el.textContent = `${new Date().toISOString().slice(11, 23)} ${line}\n` + el.textContent.slice(0, 8000);
  }
  function render() {
    $("worker-id").textContent = worker.id || "–";
    const slots = [...worker.slots.values()].filter((s) => s.plan > 0);
    $("units").textContent = slots.length ? slots.map((s) => `[${s.start}, ${s.end}) plan ${s.plan}`).join("; ") : "–";
    if (document.body.dataset.state === "joined") {
      $("message").textContent = slots.length ? `serving units ${$("units").textContent} as ${worker.id}`
        : worker.notice || `joined as ${worker.id}; waiting for a stage`;
    }
    if (slots.length) worker.notice = null; // what the coordinator was preparing is here
    if (worker.notice) document.body.dataset.preparing = "1"; else delete document.body.dataset.preparing;
    $("computed").textContent = String(stats.computed);
    $("tokens").textContent = String(stats.tokens);
    $("held").textContent = `${stats.held} files, ${fmtBytes(stats.heldBytes)}`;
    $("held").dataset.count = String(stats.held);
    $("hits").textContent = String(stats.hits);
    $("fetched").textContent = String(stats.fetched);
  }
  // A plan id as the log names it (net.messages.plan_label): calibration's ranges and the spare have negative ids.
  const planLabel = (plan) => (plan > 0 ? `plan ${plan}` : plan <= LIMITS.CALIBRATION_PLANS ? "calibration" : plan < 0 ? "the spare plan" : "a link probe");
  const fmtBytes = (n) => (n >= 1e9 ? `${(n / 1e9).toFixed(2)} GB` : n >= 1e6 ? `${(n / 1e6).toFixed(1)} MB` : `${(n / 1e3).toFixed(1)} kB`);
  const firstLine = (e) => String((e && e.message) || e || "error").split("\n")[0];
  // An error with its wire code (docs/protocol.md, error codes), as the Python worker sends them.
  const coded = (message, code) => Object.assign(new Error(message), { code });
  const BASIC_SAMPLING = new Set(P.SAMPLING_FIELDS); // what every head reads; the rest are extensions

  // -- frames: u32 LE header length | msgpack header | tensor bytes (docs/protocol.md) ------------
  function encodeFrame(type, fields = {}, tensors = {}) {
    const specs = [], blobs = [];
    for (const [name, t] of Object.entries(tensors)) {
      specs.push([name, t.dtype, t.shape.map(Number)]);
      blobs.push(new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength));
    }
    const header = MessagePack.encode({ ...fields, type, v: PROTOCOL, tensors: specs });
    const out = new Uint8Array(4 + header.length + blobs.reduce((n, b) => n + b.length, 0));
    new DataView(out.buffer).setUint32(0, header.length, true);
    out.set(header, 4);
    let offset = 4 + header.length;
    for (const b of blobs) { out.set(b, offset); offset += b.length; }
    return out;
  }

  function decodeFrame(buf) {
    if (!(buf instanceof ArrayBuffer)) throw new Error("expected a binary frame, got text");
    if (buf.byteLength < 4) throw new Error(`frame of ${buf.byteLength} bytes is shorter than its length prefix`);
    const n = new DataView(buf).getUint32(0, true);
    if (n > LIMITS.MAX_HEADER_BYTES || 4 + n > buf.byteLength) throw new Error(`header length ${n} does not fit a frame of ${buf.byteLength} bytes`);
    const header = MessagePack.decode(new Uint8Array(buf, 4, n));
    if (!header || typeof header !== "object" || Array.isArray(header)) throw new Error("header is not a map");
    if (header.v !== PROTOCOL) throw new Error(`protocol version ${header.v} is not supported (this side speaks ${PROTOCOL})`);
    const { type, v, tensors: specs = [], ...fields } = header;
    const tensors = {};
    let offset = 4 + n;
    for (const spec of Array.isArray(specs) ? specs : [null]) {
      if (!(Array.isArray(spec) && spec.length === 3 && DTYPES[spec[1]] && Array.isArray(spec[2]))) throw new Error(`bad tensor description ${JSON.stringify(spec)}`);
      const [name, dtype, shape] = spec;
      if (!shape.every((d) => Number.isInteger(d) && d >= 0)) throw new Error(`tensor ${name}: bad shape ${JSON.stringify(shape)}`);
      const [Ctor, size] = DTYPES[dtype];
      const bytes = shape.reduce((a, d) => a * d, 1) * size;
      if (offset + bytes > buf.byteLength) throw new Error(`tensor ${name} needs ${bytes} bytes, frame has ${buf.byteLength - offset} left (truncated)`);
      tensors[name] = { dtype, shape, data: new Ctor(buf.slice(offset, offset + bytes)) }; // slice: aligned copy
      offset += bytes;
    }
    if (offset !== buf.byteLength) throw new Error(`${buf.byteLength - offset} unexpected bytes after the tensors`);
    return { type, fields, tensors };
  }

  function halfToFloat(h16) {
    const out = new Float32Array(h16.length);
    for (let i = 0; i < h16.length; i++) {
      const h = h16[i], s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
      out[i] = e === 0 ? s * f * 2 ** -24 : e === 31 ? (f ? NaN : s * Infinity) : s * (1 + f / 1024) * 2 ** (e - 15);
    }
    return out;
  }

  // -- SHA-256 (crypto.subtle where the page is a secure context, else this fallback) -------------
  const K256 = new Uint32Array([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
    0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
    0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
    0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
    0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2]);

  function sha256Fallback(bytes) {
    const H = new Uint32Array([0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19]);
    const W = new Uint32Array(64);
    const block = (view, at) => {
      for (let i = 0; i < 16; i++) W[i] = view.getUint32(at + 4 * i);
      for (let i = 16; i < 64; i++) {
        const a = W[i - 15], b = W[i - 2];
        const s0 = ((a >>> 7) | (a << 25)) ^ ((a >>> 18) | (a << 14)) ^ (a >>> 3);
        const s1 = ((b >>> 17) | (b << 15)) ^ ((b >>> 19) | (b << 13)) ^ (b >>> 10);
        W[i] = (W[i - 16] + s0 + W[i - 7] + s1) | 0;
      }
      let [a, b, c, d, e, f, g, h] = H;
      for (let i = 0; i < 64; i++) {
        const S1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7));
        const t1 = (h + S1 + ((e & f) ^ (~e & g)) + K256[i] + W[i]) | 0;
        const S0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10));
        const t2 = (S0 + ((a & b) ^ (a & c) ^ (b & c))) | 0;
        h = g; g = f; f = e; e = (d + t1) | 0; d = c; c = b; b = a; a = (t1 + t2) | 0;
      }
      H[0] += a; H[1] += b; H[2] += c; H[3] += d; H[4] += e; H[5] += f; H[6] += g; H[7] += h;
    };
    const full = bytes.length - (bytes.length % 64);
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    for (let at = 0; at < full; at += 64) block(view, at);
    const tail = new Uint8Array(bytes.length % 64 < 56 ? 64 : 128);
    tail.set(bytes.subarray(full));
    tail[bytes.length - full] = 0x80;
    const tv = new DataView(tail.buffer);
    tv.setUint32(tail.length - 8, Math.floor(bytes.length / 2 ** 29));
    tv.setUint32(tail.length - 4, (bytes.length * 8) >>> 0);
    for (let at = 0; at < tail.length; at += 64) block(tv, at);
    return [...H].map((x) => x.toString(16).padStart(8, "0")).join("");
  }

  async function sha256(bytes) {
    if (self.crypto && crypto.subtle) {
      const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
      return [...digest].map((x) => x.toString(16).padStart(2, "0")).join("");
    }
    return sha256Fallback(bytes);
  }

  // -- unit files, cached by hash: Cache Storage in a secure context, IndexedDB elsewhere -------
  class UnitStore {
    async open() {
      if (self.caches && self.isSecureContext) {
        this.cache = await caches.open("edgepipe-units-v1");
        this.kind = "Cache Storage";
      } else {
        this.db = await new Promise((resolve, reject) => {
          const req = indexedDB.open("edgepipe-units", 1);
          req.onupgradeneeded = () => req.result.createObjectStore("blobs");
          req.onsuccess = () => resolve(req.result);
          req.onerror = () => reject(req.error);
        });
        this.kind = "IndexedDB";
      }
      return this;
    }
    url(sha) { return new URL(`/v1/blobs/${sha}`, location.href).href; }
    idb(mode, fn) {
      return new Promise((resolve, reject) => {
        const req = fn(this.db.transaction("blobs", mode).objectStore("blobs"));
        req.onsuccess = () => resolve(req.result);
        req.onerror = () => reject(req.error);
      });
    }
    async held() {
      if (this.cache) return (await this.cache.keys()).map((r) => r.url.split("/").pop()).filter((s) => /^[0-9a-f]{64}$/.test(s));
      return (await this.idb("readonly", (s) => s.getAllKeys())).map(String);
    }
    async get(sha) {
      if (this.cache) {
        const hit = await this.cache.match(this.url(sha));
        return hit ? new Uint8Array(await hit.arrayBuffer()) : null;
      }
      const buf = await this.idb("readonly", (s) => s.get(sha));
      return buf ? new Uint8Array(buf) : null;
    }
    async put(sha, bytes) {
      if (this.cache) await this.cache.put(this.url(sha), new Response(bytes, { headers: { "Content-Type": "application/octet-stream", "X-Bytes": String(bytes.length) } }));
      else await this.idb("readwrite", (s) => s.put(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength), sha));
    }
  }

  // -- a stage: one onnxruntime-web session over units [start, end) + per-sequence KV ------------
  // On WebGPU the KV cache stays in GPU memory across steps: present_* come back as GPU buffers
  // (preferredOutputLocation) and are fed as past_* of the next step; only growing the capacity
  // (every KV_BLOCK positions) passes the live prefix through the host.
  class StageRunner {
    // prefillChunk: a run of more new positions than this goes as consecutive runs of at most this many (0: whole).
    constructor(session, maxContext, onGpu = false, prefillChunk = 0) {
      this.session = session;
      this.onGpu = onGpu;
      this.prefillChunk = prefillChunk;
      const inputs = session.inputNames, outputs = session.outputNames;
      const meta = Object.fromEntries((session.inputMetadata || []).map((m) => [m.name, m]));
      this.layers = inputs.map((n) => /^past_key\.(\d+)$/.exec(n)).filter(Boolean).map((m) => Number(m[1])).sort((a, b) => a - b);
      this.takesTokenIds = inputs.includes("input_ids");
      this.inputName = this.takesTokenIds ? "input_ids" : inputs.find((n) => n.startsWith("hidden."));
      this.emitsTokens = outputs.includes("next_token");
      this.outputName = this.emitsTokens ? "next_token" : outputs.find((n) => n.startsWith("hidden."));
      if (this.layers.length) {
        const shape = meta[`past_key.${this.layers[0]}`].shape; // [batch, kv_heads, capacity, head_dim]
        this.kvHeads = Number(shape[1]);
        this.headDim = Number(shape[3]);
      }
      this.hidden = this.takesTokenIds ? null : Number(meta[this.inputName].shape[2]); // [batch, seq, hidden]
      // A head with logit controls and logprob outputs (graphs.py, version 2+): fed from the sampling
      // entry (headFeeds), new tensors for every run (with the proxy, a run's input buffers move to its thread).
      if (this.emitsTokens && inputs.includes("logit_adjust")) {
        const vocab = Number(meta.logit_adjust.shape[1]);
        const repeat = inputs.includes("repeat_ids"); // graphs.py version 8: the repeat penalty
        this.headControls = (s, added) => headFeeds(s, vocab, added, repeat);
      }
      this.maxContext = maxContext;
      this.caches = new Map(); // seq -> {length, capacity, kv: {"key.u": ort.Tensor [1, kv_heads, capacity, head_dim]}}
    }

    drop(seq) {
      const cache = this.caches.get(seq);
      if (cache) disposeAll(cache.kv);
      this.caches.delete(seq);
    }

    get kvBytes() {
      let n = 0;
      for (const c of this.caches.values()) n += 2 * this.layers.length * this.kvHeads * c.capacity * this.headDim * 4;
      return n;
    }

    // Grow the KV buffers to hold `tokens` positions: a bigger zeroed buffer with the live prefix copied in
    // (a GPU buffer is read back, one layer at a time, and released; the next run uploads the grown one).
    async reserve(cache, tokens) {
      if (tokens <= cache.capacity) return;
      const capacity = Math.ceil(tokens / KV_BLOCK) * KV_BLOCK;
      const rows = this.headDim;
      for (const u of this.layers) {
        for (const kind of ["key", "value"]) {
          const name = `${kind}.${u}`;
          const grown = new Float32Array(this.kvHeads * capacity * rows);
          const old = cache.kv[name];
          if (old && cache.length) {
            const data = old.location === "gpu-buffer" ? await old.getData(true) : old.data;
            for (let h = 0; h < this.kvHeads; h++) {
              const from = h * cache.capacity * rows;
              grown.set(data.subarray(from, from + cache.length * rows), h * capacity * rows);
            }
          } else if (old) {
            old.dispose();
          }
          cache.kv[name] = new ort.Tensor("float32", grown, [1, this.kvHeads, capacity, rows]);
        }
      }
      cache.capacity = capacity;
    }

    // Feed S new positions of one sequence; returns hidden [1, S, H] float32 or next_token [1] int64 (the
    // head's logprobs in lastOut). With prefillChunk, S over it run as consecutive chunks of at most that many:
    // the KV advances chunk by chunk as it does across steps, hidden is the chunks' rows in order, the token
    // and its logprobs are the last chunk's, the prompt logprobs (sampling.targets, one a position) all chunks'.
    async run(seq, x, sampling) {
      const added = Number(x.shape[1]), chunk = this.prefillChunk;
      if (!(chunk > 0 && added > chunk && this.layers.length)) return this.runOnce(seq, x, sampling);
      const held = (this.caches.get(seq) || { length: 0 }).length;
      // refused before the first chunk moves the KV, as a whole run would be
      if (this.maxContext && held + added > this.maxContext) throw coded(`sequence ${seq} would reach ${held + added} tokens, over the context of ${this.maxContext}`, CODE.CONTEXT);
      const width = x.data.length / added, outs = [], heads = [];
      // targets of another length than the run go whole to the first chunk, whose head refuses them before it runs
      const slicing = sampling && sampling.targets && sampling.targets.length === added;
      for (let at = 0; at < added; at += chunk) {
        const n = Math.min(chunk, added - at);
        const part = { dtype: x.dtype, shape: [1, n, ...x.shape.slice(2)], data: x.data.slice(at * width, (at + n) * width) }; // a copy: the proxy moves a run's input buffers
        outs.push(await this.runOnce(seq, part, slicing ? { ...sampling, targets: sampling.targets.slice(at, at + n) } : sampling));
        if (this.emitsTokens) heads.push(this.lastOut);
      }
      if (!this.emitsTokens) return joinPositions(outs);
      this.lastOut = { ...heads[heads.length - 1] };
      if (slicing) for (const name of ["prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs"]) this.lastOut[name] = joinPositions(heads.map((h) => h[name]));
      return outs[outs.length - 1];
    }

    // One run of the session over S new positions (see run).
    async runOnce(seq, x, sampling) {
      const added = Number(x.shape[1]);
      let cache = this.caches.get(seq);
      if (!cache) this.caches.set(seq, (cache = { length: 0, capacity: 0, kv: {} }));
      const total = cache.length + added;
      if (this.maxContext && total > this.maxContext) throw coded(`sequence ${seq} would reach ${total} tokens, over the context of ${this.maxContext}`, CODE.CONTEXT);
      const feeds = { [this.inputName]: new ort.Tensor(x.dtype, x.data, x.shape) };
      // Absolute positions: sliding-window layers rotate at them, a learned-position embedding (GPT-2) adds their rows.
      if (this.session.inputNames.includes("position_ids")) {
        feeds.position_ids = new ort.Tensor("int64", BigInt64Array.from({ length: added }, (_, i) => BigInt(cache.length + i)), [1, added]);
      }
      if (this.layers.length) {
        await this.reserve(cache, total);
        const lengths = { seqlens_k: Int32Array.of(total - 1), total_sequence_length: Int32Array.of(total) };
        // Sliding-window layers (graphs.layer_unit) read window_* lengths and rotate at position_ids; this
        // tab keeps every position of every layer (buffer index = position), so their lengths are the same.
        for (const [name, value] of Object.entries(lengths)) {
          for (const input of [name, `window_${name}`]) {
            if (this.session.inputNames.includes(input)) feeds[input] = new ort.Tensor("int32", value.slice(), name === "seqlens_k" ? [1] : []);
          }
        }
        for (const u of this.layers) {
          feeds[`past_key.${u}`] = cache.kv[`key.${u}`];
          feeds[`past_value.${u}`] = cache.kv[`value.${u}`];
        }
      }
      if (this.emitsTokens) {
        const s = sampling || { do_sample: false, temperature: 1, top_k: 0, top_p: 1, uniform: 0 };
        feeds.do_sample = new ort.Tensor("bool", Uint8Array.of(s.do_sample ? 1 : 0), []);
        feeds.temperature = new ort.Tensor("float32", Float32Array.of(s.temperature), [1]);
        feeds.top_k = new ort.Tensor("int64", BigInt64Array.of(BigInt(s.do_sample ? Math.trunc(s.top_k) : 1)), [1]);
        feeds.top_p = new ort.Tensor("float32", Float32Array.of(s.top_p), [1]);
        feeds.uniform = new ort.Tensor("float32", Float32Array.of(s.uniform), [1]);
        if (this.session.inputNames.includes("min_p")) { // heads of GRAPH_VERSION 10 on; absent from the wire: 0 (off)
          feeds.min_p = new ort.Tensor("float32", Float32Array.of(s.do_sample ? Number(s.min_p || 0) : 0), [1]);
        } else if (s.do_sample && s.min_p) throw coded("this head cannot apply min_p (built before GRAPH_VERSION 10)", CODE.BAD_INPUT);
        if (this.headControls) Object.assign(feeds, this.headControls(s, added));
      }
      const out = await this.session.run(feeds);
      if (this.emitsTokens) this.lastOut = out; // the head's logprobs (logprobsEntry)
      // Past and present cannot share one buffer here: present (same capacity, past + the new
      // rows) becomes the sequence's buffer for the next step, and past's GPU buffer is released.
      for (const u of this.layers) {
        for (const kind of ["key", "value"]) {
          const present = out[`present_${kind}.${u}`], past = cache.kv[`${kind}.${u}`];
          if (Number(present.dims[2]) < total) throw new Error(`present_${kind}.${u} holds ${present.dims[2]} positions, need ${total}`);
          if (past !== present && past.location === "gpu-buffer") past.dispose();
          cache.kv[`${kind}.${u}`] = present;
        }
      }
      if (this.layers.length) cache.capacity = Number(out[`present_key.${this.layers[0]}`].dims[2]);
      cache.length = total;
      return out[this.outputName];
    }

    // Free the session once the compute queue reaches this point (a step may still be running on it).
    release() {
      serial(() => {
        for (const seq of [...this.caches.keys()]) this.drop(seq);
        return this.session.release();
      }).catch(() => {});
    }
  }

  // Tensors of one row ([1, S_i, ...]) joined along their positions: [1, sum S_i, ...], as {data, dims}.
  function joinPositions(parts) {
    const data = new parts[0].data.constructor(parts.reduce((n, t) => n + t.data.length, 0));
    let at = 0;
    for (const t of parts) { data.set(t.data, at); at += t.data.length; }
    const dims = parts[0].dims.map(Number);
    return { data, dims: [dims[0], parts.reduce((n, t) => n + Number(t.dims[1]), 0), ...dims.slice(2)] };
  }

  function disposeAll(tensors) {
    for (const t of Object.values(tensors)) if (t.location === "gpu-buffer") t.dispose();
  }

  // -- the worker ----------------------------------------------------------------------------------
  function parseBytes(text) {
    const m = /^\s*([\d.]+)\s*([kmgt]?i?b?)?\s*$/i.exec(text || "");
    if (!m) return null;
    const unit = (m[2] || "").toLowerCase().replace(/i?b$/, "");
    return Math.round(Number(m[1]) * ({ "": 1, k: 2 ** 10, m: 2 ** 20, g: 2 ** 30, t: 2 ** 40 }[unit] || 1));
  }

  const worker = {
    id: null,
    ws: null,
    token: params.get("token") || "",
    name: params.get("name") || "browser",
    memoryBytes: parseBytes(params.get("memory")) || Math.round((navigator.deviceMemory || 4) * 2 ** 30),
    threads: Number(params.get("threads")) || (self.crossOriginIsolated ? Math.max(1, Math.min(4, Math.floor((navigator.hardwareConcurrency || 2) / 2))) : 1),
    slots: new Map(), // plan -> {plan, start, end, runner, next, weightBytes}
    dropped: new Set(), // the last DROPPED_KEPT sequence ids dropped here, oldest first: a stale frame of one brings no KV back
    store: null,
    queued: 0,
    compute: Promise.resolve(), // forwards, drops and probes run one at a time, in arrival order
    stats,
    refused: false,
    retry: null,
    device: { kind: "cpu", adapter: null, note: "not looked for yet" }, // see findDevice
    notice: null, // the coordinator's last NOTICE while this tab waits for a stage (e.g. its fp32 units being built)
  };
  // WebAssembly memory is 32-bit: a tab computing there holds at most 4 GiB, whatever the machine has
  // (declared as its budget unless ?memory= says otherwise, so that the planner gives it no more).
  const WASM_MEMORY_BYTES = 4 * 2 ** 30;

  // Where this tab computes: WebGPU when the browser gives an adapter (?device=cpu opts out),
  // else WebAssembly, with one line saying why.
  async function findDevice() {
    if (params.get("device") === "cpu") return { kind: "cpu", adapter: null, note: "the page asked for the CPU (?device=cpu)" };
    if (!navigator.gpu) return { kind: "cpu", adapter: null, note: `no navigator.gpu${self.isSecureContext ? "" : " (not a secure context)"}` };
    let adapter;
    try {
      adapter = await navigator.gpu.requestAdapter();
    } catch (e) {
      return { kind: "cpu", adapter: null, note: `requestAdapter failed: ${firstLine(e)}` };
    }
    if (!adapter) return { kind: "cpu", adapter: null, note: "no WebGPU adapter" };
    const info = adapter.info || {};
    const name = [info.vendor, info.architecture, info.description].filter(Boolean).join(" ") || "unnamed adapter";
    return { kind: "gpu", adapter: name, note: null, ...prefillChunking(info) };
  }

  // Whether this adapter's prefills go in chunks of WEBGPU_PREFILL_CHUNK (see there), from what it reports:
  // SwiftShader, and any adapter whose subgroups may be under TRUSTED_SUBGROUP or that does not say, chunk.
  // ?prefill_chunk=N overrides it on any device (0: whole prefills, as onnxruntime-web runs them).
  function prefillChunking(info) {
    const min = Number(info.subgroupMinSize) || 0;
    const why = /swiftshader/i.test(`${info.vendor} ${info.architecture}`) ? "SwiftShader"
      : !min ? "the adapter does not report its subgroup size"
      : min < TRUSTED_SUBGROUP ? `its subgroups may be ${min} wide` : null;
    return { prefillChunk: why ? WEBGPU_PREFILL_CHUNK : 0, prefillWhy: why };
  }

  // The chunk a stage's runs are cut to on this device (StageRunner's prefillChunk), and a line saying why.
  function prefillSetting(d) {
    const asked = params.get("prefill_chunk");
    if (asked !== null) {
      const n = Number(asked);
      if (!(Number.isInteger(n) && n >= 0)) throw new Error(`?prefill_chunk= must be a whole number of positions, got ${asked}`);
      return { chunk: n, line: n ? `prefills run in chunks of at most ${n} positions (?prefill_chunk=${n})` : "prefills run whole (?prefill_chunk=0)" };
    }
    if (d.kind !== "gpu" || !d.prefillChunk) return { chunk: 0, line: null };
    return { chunk: d.prefillChunk, line: `prefills run in chunks of at most ${d.prefillChunk} positions on this adapter (${d.prefillWhy}): ` +
             `onnxruntime-web's FlashAttention prefill shader, taken at ${d.prefillChunk + 1}+ new positions, is wrong on SwiftShader's 4-wide subgroups` };
  }

  // A WebGPU session could not be built: from now on this tab computes on WebAssembly, and it joins
  // again so that the coordinator learns the device and sends the fp32 variant.
  function leaveTheGpu(reason) {
    worker.device = { kind: "cpu", adapter: null, note: `WebGPU session failed: ${reason}` };
    log(`${worker.device.note}; joining again on WebAssembly`);
    showDevice();
    setTimeout(connect, 0);
  }

  function showDevice() {
    const d = worker.device;
    $("device").textContent = d.kind === "gpu" ? `GPU (WebGPU): ${d.adapter}` : `CPU (WebAssembly): ${d.note}`;
    $("device").dataset.kind = d.kind;
  }

  function serial(fn) {
    worker.queued++;
    const run = worker.compute.then(fn).finally(() => { worker.queued--; render(); });
    worker.compute = run.catch(() => {});
    return run;
  }

  // A frame's fields must be the message's own (protocol.js): a field renamed in net/messages.py
  // fails here, in the browser tests, rather than being dropped by the coordinator.
  function send(type, fields, tensors) {
    const declared = FIELDS[type];
    if (!declared) throw new Error(`no message type ${type} in protocol.js`);
    for (const name of Object.keys(fields)) if (!declared.has(name)) throw new Error(`${type} has no field ${name} (protocol.js)`);
    const ws = worker.ws;
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(encodeFrame(type, fields, tensors));
  }

  async function refreshHeld() {
    const held = await worker.store.held();
    stats.held = held.length;
    return held;
  }

  async function connect() {
    clearTimeout(worker.retry);
    if (worker.ws) { worker.ws.onclose = null; worker.ws.close(); }
    dropAll();
    worker.refused = false;
    worker.id = null;
    const held = await refreshHeld();
    render();
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/worker`;
    const ws = (worker.ws = new WebSocket(url));
    ws.binaryType = "arraybuffer";
    show("connecting", `connecting to ${url}…`);
    ws.onopen = () => send(T.HELLO, hello(held));
    ws.onmessage = (ev) => onFrame(ev.data);
    ws.onclose = (ev) => {
      if (worker.ws !== ws) return;
      dropAll();
      const wasJoined = worker.id !== null;
      worker.id = null;
      render();
      if (worker.refused) return;
      show("disconnected", `${wasJoined ? "connection to the coordinator closed" : "cannot reach the coordinator"}` +
           `${ev.reason ? `: ${ev.reason}` : ""}; retrying in 3 s`);
      worker.retry = setTimeout(connect, 3000);
    };
  }

  // The hello: every field of net.messages.Hello, null ones too (a field added there since is sent
  // null), as Hello.to_message writes it (the golden-frames test checks this frame and parses it).
  function hello(held) {
    const d = worker.device;
    const given = {
      name: worker.name, token: worker.token || null, protocol: PROTOCOL, kind: "browser",
      memory_bytes: d.kind === "gpu" || params.get("memory") ? worker.memoryBytes : Math.min(worker.memoryBytes, WASM_MEMORY_BYTES),
      threads: worker.threads,
      data_url: null,  // a tab accepts no connections: its activations travel through the coordinator
      held, emulation: null,
      // On WebGPU no precision: the package's own variant (MatMulNBits runs there); WebAssembly runs fp32 fastest.
      precision: d.kind === "gpu" ? null : "fp32",
      pid: null, data_fingerprint: null, power_busy_w: null, power_idle_w: null,
      device: d.kind, adapter: d.adapter ?? null, device_note: d.note ?? null,
      native_kernel: null, native_kernel_note: null,  // the GGUF kernel library is native only
      role: null,  // a tab holds stages; drafting (--role drafter) is a native worker's
    };
    for (const name of Object.keys(given)) if (!FIELDS[T.HELLO].has(name)) throw new Error(`hello has no field ${name} (protocol.js)`);
    return Object.fromEntries(P.FIELDS[T.HELLO].map((name) => [name, given[name] === undefined ? null : given[name]]));
  }

  function dropAll() {
    for (const slot of worker.slots.values()) slot.runner.release();
    worker.slots.clear();
  }

  // -- decisions: handle(state, frame) -> commands, beside edgepipe/worker/core.py's handle -----
  // handle decides from the tab's state (`worker`, read only) what a coordinator frame asks for;
  // perform carries the commands out (the socket, the page, the unit store, onnxruntime-web).
  // FORWARD and DROP are decided in compute order, once the frames queued before them are done,
  // so a frame is checked against the KV as it stands when its turn comes (as in the core).
  const COMPUTE_ORDERED = new Set([T.FORWARD, T.DROP]);
  const DROPPED_KEPT = 4096; // as worker/core.py's

  function onFrame(data) {
    let frame;
    try {
      frame = decodeFrame(data);
    } catch (e) {
      log(`bad frame from the coordinator: ${firstLine(e)}`);
      return;
    }
    const step = async () => perform(handle(worker, frame)); // async: a decision that throws is logged, not left uncaught
    (COMPUTE_ORDERED.has(frame.type) ? serial(step) : step()).catch((e) => log(`${frame.type} failed: ${firstLine(e)}`));
  }

  function handle(state, { type, fields: f, tensors }) {
    switch (type) {
      case T.WELCOME:
        return [{ op: "joined", id: f.worker_id }];
      case T.ERROR: // before a welcome: refused at the door (e.g. a wrong or missing join token)
        return state.id === null ? [{ op: "refused", message: f.message }] : [{ op: "log", line: `coordinator: ${f.message}` }];
      case T.PING:
        return [{ op: "send", type: T.PONG, fields: { t: f.t, kv_bytes: kvBytes(state), queue: state.queued, busy_s: state.stats.busy_s,
                                                       computed: state.stats.computed } }];
      case T.LOAD:
        return [{ op: "fetchAndBuild", load: f }];
      case T.ACTIVATE: {
        const keep = new Set(f.keep);
        return [...state.slots.keys()].filter((plan) => !keep.has(plan)).map((plan) => ({ op: "release", plan }));
      }
      case T.DROP: // in compute order: a running step may still read the sequence's GPU buffers
        return [{ op: "dropSequence", seq: f.seq }];
      case T.FORWARD:
        return forwardCommands(state, f, tensors);
      case T.PROBE:
        return [{ op: "runProbe", probe: f }];
      case T.KV_EXPORT: // KV moves need the data port a tab does not have: the coordinator re-runs prefill instead
        return [{ op: "send", type: T.LOADED, fields: { kv_received: f.move === undefined ? null : f.move, ok: false,
                                                         error: "browser workers do not move KV" } }];
      case T.NOTICE: // what the coordinator prepares for this tab (no reply): shown until a stage arrives
        return [{ op: "showNotice", notice: f }];
      case T.BYE:
        return [{ op: "stopped" }];
      default:
        return [{ op: "log", line: `ignored ${type}` }];
    }
  }

  // Sequence ids are never run again after a DROP (as worker/core.py's without_dropped): an entry of a
  // dropped id this tab does not hold is a stale frame (it sat behind a stall while the coordinator
  // replayed the request) and is discarded, lest it bring the dropped KV back. [f, tensors], or [null] when none is left.
  function withoutDropped(state, f, tensors) {
    const batch = Array.isArray(f.batch) ? f.batch : [];
    const slot = state.slots.get(f.plan);
    if (!batch.some((item) => item && state.dropped.has(item.seq))) return [f, tensors];
    if (slot && !slot.runner.layers.length) return [f, tensors]; // an embedding or a head alone holds no KV to tell
    const held = (seq) => slot && (slot.runner.caches.get(seq) || { length: 0 }).length > 0;
    const keep = batch.map((item, i) => [item, i]).filter(([item]) => !(item && state.dropped.has(item.seq)) || held(item.seq)).map(([, i]) => i);
    if (keep.length === batch.length) return [f, tensors];
    if (!keep.length) return [null, null];
    const x = tensors.x;
    if (!x || Number(x.shape[0]) !== batch.length) return [f, tensors]; // malformed: refused as such below
    const row = x.data.length / batch.length;
    const data = new x.data.constructor(keep.length * row);
    keep.forEach((i, j) => data.set(x.data.subarray(i * row, (i + 1) * row), j * row));
    return [{ ...f, batch: keep.map((i) => batch[i]) }, { ...tensors, x: { ...x, shape: [keep.length, ...x.shape.slice(1)], data } }];
  }

  // One error frame per sequence of a FORWARD (as the core's errors for a refused frame).
  const errorFrames = (f, message, code) => (Array.isArray(f.batch) ? f.batch : [{}]).map((item) => (
    { op: "send", type: T.ERROR, fields: { message, code, seq: item.seq, step: item.step, rid: item.rid } }));

  // A FORWARD lane, checked before it runs (as core.forward_problem): the stage exists, x fits the
  // batch, activations are sane, each sequence's KV ends where the frame starts, and the head can
  // apply what the sampling asks. Either error frames or one compute command.
  function forwardCommands(state, f, tensors) {
    [f, tensors] = withoutDropped(state, f, tensors);
    if (!f) return [];
    const refuse = (message, code) => errorFrames(f, message, code);
    const slot = state.slots.get(f.plan);
    if (!slot) return refuse(`worker ${state.id} holds no stage for plan ${f.plan}`, CODE.NO_STAGE);
    let x = tensors.x;
    if (!x) return refuse("forward without an x tensor", CODE.BAD_INPUT);
    const batch = f.batch || [];
    if (Number(x.shape[0]) !== batch.length || !batch.length) return refuse(`forward frame: x has ${x.shape[0]} rows for ${batch.length} sequences`, CODE.BAD_INPUT);
    if (x.dtype === "float16") x = { dtype: "float32", shape: x.shape, data: halfToFloat(x.data) };
    if (!slot.runner.takesTokenIds) { // what the predecessor sent, checked before use (as validate.activation_problem)
      const problem = activationProblem(x, slot.runner.hidden, slot.runner.maxContext);
      if (problem) return refuse(`plan ${f.plan}: ${problem}`, CODE.CORRUPT_INPUT);
    }
    for (const item of batch) { // a frame must start where the sequence's cache ends: a lost frame leaves a hole
      const held = (slot.runner.caches.get(item.seq) || { length: 0 }).length;
      if (Number.isInteger(item.pos) && slot.runner.layers.length && item.pos !== held) {
        return refuse(`plan ${f.plan}: ${item.seq} holds ${held} positions, the frame starts at ${item.pos} (a frame was lost)`, CODE.CORRUPT_INPUT);
      }
    }
    if (slot.runner.emitsTokens && !slot.runner.headControls) { // a head older than logit controls: refuse rather than ignore them
      const asked = [...new Set(batch.flatMap((item) => Object.entries(item.sampling || {})
        .filter(([k, v]) => !BASIC_SAMPLING.has(k) && v !== null && v !== undefined && v !== false && v !== 0 && !(Array.isArray(v) && !v.length))
        .map(([k]) => k)))];
      if (asked.length) return refuse(`a browser worker does not apply ${asked.join(", ")} (sampling extensions)`, CODE.BAD_INPUT);
    }
    return [{ op: "runStage", f, slot, x, batch }];
  }

  async function perform(commands) {
    for (const c of commands) {
      switch (c.op) {
        case "send": send(c.type, c.fields); break;
        case "log": log(c.line); break;
        case "joined":
          worker.id = c.id;
          worker.notice = null;
          worker.dropped.clear(); // a new membership: ids are counted afresh
          show("joined", `joined as ${worker.id}; waiting for a stage`);
          break;
        case "refused":
          worker.refused = true;
          show("refused", `the coordinator refused this worker: ${c.message}`);
          break;
        case "fetchAndBuild": worker.notice = null; await load(c.load); break; // the stage it was preparing has come
        case "showNotice": {
          const f = c.notice;
          worker.notice = f.total ? `${f.text} [${"#".repeat(Math.round(10 * f.done / f.total)).padEnd(10, ".")}]` : f.text;
          if (f.done === f.total || !f.total) log(`coordinator: ${f.text}`);
          break;
        }
        case "release": worker.slots.get(c.plan).runner.release(); worker.slots.delete(c.plan); break;
        case "dropSequence":
          for (const slot of worker.slots.values()) slot.runner.drop(c.seq);
          worker.dropped.delete(c.seq);
          worker.dropped.add(c.seq);
          if (worker.dropped.size > DROPPED_KEPT) worker.dropped.delete(worker.dropped.values().next().value);
          break;
        case "runStage": // a failure while running (a head control out of range, the context outgrown) fails the lane
          await compute(c).catch((e) => perform(errorFrames(c.f, firstLine(e), e.code || CODE.INTERNAL)));
          break;
        case "runProbe": await probe(c.probe); break;
        case "stopped": show("stopped", "the coordinator said bye"); break;
        default: throw new Error(`no such command ${c.op}`);
      }
    }
    render();
  }

  const kvBytes = (state) => [...state.slots.values()].reduce((n, s) => n + s.runner.kvBytes, 0);

  const inflight = new Map(); // sha -> Promise: two loads that share a file download it once
  function fetchUnit(sha) {
    const running = inflight.get(sha);
    if (running) return running.then((r) => ({ bytes: r.bytes, fetched: 0 }));
    const once = fetchUnitOnce(sha).finally(() => inflight.delete(sha));
    inflight.set(sha, once);
    return once;
  }

  // Cached bytes are hashed once per page before use (with crypto.subtle; the pure-JS fallback of
  // a non-secure context is too slow to re-hash a model on every load, so there they are trusted).
  const verified = new Set();
  async function fetchUnitOnce(sha) {
    const cached = await worker.store.get(sha);
    if (cached) {
      if (verified.has(sha) || !(self.crypto && crypto.subtle) || (await sha256(cached)) === sha) { verified.add(sha); stats.hits++; return { bytes: cached, fetched: 0 }; }
      log(`cached unit file ${sha.slice(0, 16)}… is corrupt: fetching it again`);
    }
    const headers = worker.token ? { Authorization: `Bearer ${worker.token}` } : {};
    const resp = await fetch(`/v1/blobs/${sha}`, { headers, cache: "no-store" });
    if (!resp.ok) throw new Error(`unit file ${sha.slice(0, 16)}…: HTTP ${resp.status}`);
    const bytes = new Uint8Array(await resp.arrayBuffer());
    const digest = await sha256(bytes);
    if (digest !== sha) throw new Error(`unit file ${sha.slice(0, 16)}…: sha256 is ${digest.slice(0, 16)}…`);
    verified.add(sha);
    try {
      await worker.store.put(sha, bytes);
      stats.heldBytes += bytes.length;
    } catch (e) {
      log(`could not cache ${sha.slice(0, 16)}…: ${firstLine(e)}`);
    }
    stats.fetched += bytes.length;
    return { bytes, fetched: bytes.length };
  }

  async function load(f) {
    const t0 = performance.now();
    let reply;
    try {
      let fetched = 0, weightBytes = 0;
      const graph = await fetchUnit(f.graph);
      fetched += graph.fetched;
      const externalData = [];
      for (const sha of f.files) {
        const unit = await fetchUnit(sha);
        fetched += unit.fetched;
        weightBytes += unit.bytes.length;
        externalData.push({ path: sha, data: unit.bytes }); // path must equal the tensors' `location`
      }
      await refreshHeld();
      render();
      if (f.prefetch) { // a spare plan: hold its files, build nothing yet
        send(T.LOADED, { plan: f.plan, ok: true, prefetched: true, fetched_bytes: fetched });
        log(`${planLabel(f.plan)}: prefetched units [${f.start}, ${f.end}), ${fmtBytes(fetched)}`);
        return;
      }
      const onGpu = worker.device.kind === "gpu";
      let session;
      try {
        session = await serial(() => ort.InferenceSession.create(graph.bytes, onGpu ? {
          executionProviders: ["webgpu"], graphOptimizationLevel: "all", externalData, preferredOutputLocation: kvOnGpu(f.start, f.end),
        } : { executionProviders: ["wasm"], graphOptimizationLevel: "all", externalData }));
      } catch (e) {
        if (onGpu) {
          leaveTheGpu(firstLine(e));
          return;
        }
        throw e;
      }
      const old = worker.slots.get(f.plan);
      if (old) old.runner.release();
      worker.slots.set(f.plan, { plan: f.plan, start: f.start, end: f.end, runner: new StageRunner(session, f.max_context, onGpu, prefillSetting(worker.device).chunk), next: f.next, weightBytes });
      reply = { plan: f.plan, ok: true, load_s: (performance.now() - t0) / 1000, fetched_bytes: fetched, weight_bytes: weightBytes };
      log(`${planLabel(f.plan)}: units [${f.start}, ${f.end}) ready in ${reply.load_s.toFixed(2)} s, fetched ${fmtBytes(fetched)}`);
    } catch (e) {
      reply = { plan: f.plan, ok: false, error: firstLine(e) };
      log(`${planLabel(f.plan)}: load failed: ${reply.error}`);
    }
    send(T.LOADED, reply);
    render();
  }

  // present_* of units [start, end) stay on the GPU (names a graph lacks are ignored).
  function kvOnGpu(start, end) {
    const where = {};
    for (let u = start; u < end; u++) for (const kind of ["key", "value"]) where[`present_${kind}.${u}`] = "gpu-buffer";
    return where;
  }

  // A forward frame carries one lane of sequences (`batch`, one row of x each).
  // Run a checked FORWARD lane (forwardCommands): its sequences one after the other, answered with
  // one frame, as a native worker does.
  async function compute({ f, slot, x, batch }) {
    const t0 = performance.now();
    const width = x.data.length / batch.length;
    const outs = [], logprobs = [];
    for (let i = 0; i < batch.length; i++) {
      const item = batch[i];
      const row = { dtype: x.dtype, shape: [1, ...x.shape.slice(1)], data: x.data.slice(i * width, (i + 1) * width) };
      const sampling = slot.runner.emitsTokens ? item.sampling : null;
      outs.push(await slot.runner.run(item.seq, row, sampling));
      logprobs.push(sampling && sampling.logprobs ? logprobsEntry(slot.runner.lastOut, sampling) : null);
    }
    const seconds = (performance.now() - t0) / 1000;
    stats.busy_s += seconds;
    stats.computed += batch.length;
    // [worker, seconds, positions, bytes per activation element, sequences in the call]
    const timings = [...(f.timings || []), [worker.id, seconds, Number(x.shape[1]), 4, batch.length]];
    const base = { plan: f.plan, batch, timings };
    if (slot.next.kind === "coordinator") {
      if (batch.every((item) => item.partial)) return; // replay frames before the last: no token wanted
      stats.tokens += batch.length;
      send(T.TOKEN, { ...base, tokens: outs.map((o) => Number(o.data[0])), ...(logprobs.some((e) => e) ? { logprobs } : {}) });
    } else {
      const data = new Float32Array(outs.reduce((n, o) => n + o.data.length, 0));
      let at = 0;
      for (const o of outs) { data.set(o.data, at); at += o.data.length; }
      send(T.FORWARD, { ...base, relay_to: slot.next.id }, { x: { dtype: "float32", shape: [batch.length, ...outs[0].dims.slice(1)], data } });
    }
  }

  // The head's logit_adjust / num_top / prompt_targets from a sampling entry (runtime/controls.py):
  // sparse adjust_ids/adjust, an allowed-token bitmask (bit t % 8 of byte t >> 3), top N, echo targets.
  function headFeeds(s, vocab, added, repeat) {
    s = s || {};
    const adjust = new Float32Array(vocab);
    const ids = s.adjust_ids || [], values = s.adjust || [];
    if (!Array.isArray(ids) || !Array.isArray(values) || ids.length !== values.length) throw coded("adjust_ids and adjust must be lists of one length", CODE.BAD_INPUT);
    for (let i = 0; i < ids.length; i++) {
      const t = Number(ids[i]), v = Number(values[i]);
      if (!Number.isInteger(t) || t < 0 || t >= vocab || !Number.isFinite(v)) throw coded(`logit adjustment ids must be in [0, ${vocab}) with finite values`, CODE.BAD_INPUT);
      adjust[t] += v;
    }
    if (s.mask !== undefined && s.mask !== null) {
      const m = s.mask;
      if (!(m instanceof Uint8Array) || m.length !== Math.ceil(vocab / 8)) throw coded(`token mask must be ${Math.ceil(vocab / 8)} bytes for ${vocab} tokens`, CODE.BAD_INPUT);
      let allowed = 0;
      for (let t = 0; t < vocab; t++) {
        if ((m[t >> 3] >> (t & 7)) & 1) allowed++;
        else adjust[t] = -Infinity;
      }
      if (!allowed) throw coded("token mask allows no token", CODE.BAD_INPUT);
    }
    const top = Number(s.top || 0);
    if (!Number.isInteger(top) || top < 0 || top > LIMITS.MAX_TOP_LOGPROBS) throw coded(`top logprobs must be in [0, ${LIMITS.MAX_TOP_LOGPROBS}], got ${s.top}`, CODE.BAD_INPUT);
    const targets = s.targets ? BigInt64Array.from(s.targets, (t) => BigInt(t)) : new BigInt64Array(0);
    if (s.targets && (targets.length !== added || s.targets.some((t) => !(t >= 0 && t < vocab)))) throw coded("prompt targets must be one id in the vocabulary per position of the prefill", CODE.BAD_INPUT);
    const feeds = { logit_adjust: new ort.Tensor("float32", adjust, [1, vocab]), num_top: new ort.Tensor("int64", BigInt64Array.of(BigInt(top)), [1]),
                    prompt_targets: new ort.Tensor("int64", targets, [1, targets.length]) };
    if (!repeat) {
      if (s.repeat_ids && s.repeat_ids.length) throw coded("this model package's head predates the repeat penalty: re-import the model", CODE.BAD_INPUT);
      return feeds;
    }
    // The repeat penalty (runtime/controls.py): distinct ids and a factor, as stage_runner.repeat_rows.
    const rids = s.repeat_ids || [], penalty = rids.length ? Number(s.repeat_penalty) : 1;
    if (!Array.isArray(rids) || rids.some((t) => !(Number.isInteger(Number(t)) && t >= 0 && t < vocab))) throw coded(`repeat_ids must be token ids in [0, ${vocab})`, CODE.BAD_INPUT);
    if (!(penalty > 0 && penalty <= 100)) throw coded("repeat_penalty must be a number in (0, 100]", CODE.BAD_INPUT);
    feeds.repeat_ids = new ort.Tensor("int64", BigInt64Array.from(rids, (t) => BigInt(t)), [1, rids.length]);
    feeds.repeat_penalty = new ort.Tensor("float32", Float32Array.of(penalty), [1]);
    return feeds;
  }

  // A TOKEN frame's logprobs entry from the head's outputs (stage_runner.HeadOutput.wire).
  function logprobsEntry(out, s) {
    const top = Number(s.top || 0);
    const entry = { logprob: out.token_logprob.data[0], top_ids: Array.from(out.top_ids.data.slice(0, top), Number),
                    top_logprobs: Array.from(out.top_logprobs.data.slice(0, top)) };
    if (s.targets) {
      const S = s.targets.length, N = Number(out.prompt_top_ids.dims[2]);
      const rows = (data, f) => Array.from({ length: S }, (_, i) => Array.from(data.slice(i * N, i * N + top), f));
      entry.prompt = [Array.from(out.prompt_logprobs.data), rows(out.prompt_top_ids.data, Number), rows(out.prompt_top_logprobs.data, Number)];
    }
    return entry;
  }

  function activationProblem(x, hidden, maxPositions) {
    const shape = x.shape.map(Number);
    if (shape.length !== 3 || shape[0] < 1 || shape[1] < 1) return `activations have shape ${JSON.stringify(shape)}, expected [batch, positions, hidden]`;
    if (hidden && shape[2] !== hidden) return `activations have hidden size ${shape[2]}, this stage takes ${hidden}`;
    if (maxPositions && shape[1] > maxPositions) return `activations cover ${shape[1]} positions, the context is ${maxPositions}`;
    let bad = 0;
    for (let i = 0; i < x.data.length; i++) if (!Number.isFinite(x.data[i])) bad++;
    return bad ? `non-finite activations: ${bad} of ${x.data.length} values are NaN or infinite` : null;
  }

  function randomInput(runner, n) {
    if (runner.takesTokenIds) return { dtype: "int64", shape: [1, n], data: BigInt64Array.from({ length: n }, () => BigInt(Math.floor(Math.random() * 1000))) };
    const data = new Float32Array(n * runner.hidden);
    for (let i = 0; i < data.length; i++) data[i] = Math.sqrt(-2 * Math.log(1 - Math.random())) * Math.cos(2 * Math.PI * Math.random());
    return { dtype: "float32", shape: [1, n, runner.hidden], data };
  }

  // Time decode steps of a loaded stage (as Worker._time_slot), or send a payload to time the uplink.
  async function probe(f) {
    if (f.kind === "link") { // random bytes, as the native worker sends: a compressing hop cannot flatter the uplink
      const payload = new Uint8Array(Number(f.bytes || LIMITS.LINK_PROBE_DEFAULT_BYTES));
      for (let at = 0; at < payload.length; at += 65536) crypto.getRandomValues(payload.subarray(at, at + 65536));
      send(T.PROBED, { probe: f.probe, ok: true }, { payload: { dtype: "uint8", shape: [payload.length], data: payload } });
      return;
    }
    const slot = worker.slots.get(f.plan);
    const result = { probe: f.probe, ok: !!slot };
    if (slot) {
      result.times = await serial(async () => {
        const runner = slot.runner, seq = `probe-${performance.now()}`, times = [];
        try {
          await runner.run(seq, randomInput(runner, Number(f.context || 64)), null);
          for (let i = 0; i < Number(f.reps || 8); i++) {
            const x = randomInput(runner, 1);
            const t0 = performance.now();
            await runner.run(seq, x, null);
            times.push((performance.now() - t0) / 1000);
          }
        } finally {
          runner.drop(seq);
        }
        return times;
      }).catch((e) => { result.ok = false; result.error = firstLine(e); return []; });
    }
    if (result.times) log(`probe of ${planLabel(f.plan)}: ${result.times.map((t) => (t * 1e3).toFixed(1)).join(" ")} ms`);
    send(T.PROBED, result);
  }

  // -- start ---------------------------------------------------------------------------------------
  async function start() {
    worker.device = await findDevice();
    showDevice();
    let prefill;
    try {
      prefill = prefillSetting(worker.device);
    } catch (e) {
      show("error", firstLine(e));
      return;
    }
    if (prefill.line) log(prefill.line);
    $("token").value = worker.token;
    $("join").addEventListener("submit", (ev) => {
      ev.preventDefault();
      worker.token = $("token").value.trim();
      connect();
    });
    ort.env.wasm.wasmPaths = new URL("/static/vendor/", location.href).href;
    ort.env.wasm.numThreads = worker.threads;
    // On WebAssembly onnxruntime runs in its own thread, so this one keeps answering pings. The proxy
    // cannot hand out GPU buffers (the KV kept on the GPU), and a WebGPU step mostly waits on the GPU.
    ort.env.wasm.proxy = worker.device.kind === "cpu" && params.get("proxy") !== "0";
    ort.env.logLevel = "error";
    $("backend").textContent = `onnxruntime-web ${ort.env.versions ? ort.env.versions.web || "" : ""} ` +
      `${worker.device.kind === "gpu" ? "WebGPU" : "WebAssembly"}, ` +
      `${self.crossOriginIsolated ? "cross-origin isolated" : "not cross-origin isolated (1 thread)"}`;
    $("resources").textContent = `${fmtBytes(worker.memoryBytes)} / ${worker.threads} thread${worker.threads > 1 ? "s" : ""}`;
    try {
      worker.store = await new UnitStore().open();
      const held = await worker.store.held();
      for (const sha of held) {
        const hit = worker.store.cache ? await worker.store.cache.match(worker.store.url(sha)) : null;
        stats.heldBytes += hit ? Number(hit.headers.get("x-bytes") || 0) : 0;
      }
    } catch (e) {
      show("error", `no storage for unit files: ${firstLine(e)}`);
      return;
    }
    render();
    connect();
  }

  // For tests and benchmarks (the page's own view of what it did).
  self.edgepipeWorker = { worker, stats, sha256, sha256Fallback, encodeFrame, decodeFrame, connect, serial, randomInput, handle, prefillSetting };
  start();
})();
