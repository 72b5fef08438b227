// kvmesh router console: polls /admin/replicas and /metrics every 2 s while
// the tab is visible, keeps five minutes of history in memory, and draws it.
// Plain browser JavaScript, no libraries: the page must work offline.
'use strict';

(() => {
  const POLL_MS = 2000;
  const HISTORY_MS = 5 * 60 * 1000; // what the charts show
  const HIT_WINDOW_MS = 30 * 1000; // hit rates are ratios of counter increases over this window
  const RATE_WINDOW_MS = 10 * 1000; // per-second rates
  const FETCH_TIMEOUT_MS = 1800;
  const TOKEN_KEY = 'kvmesh.adminToken';

  // Counters the page reads; "name" or "name|label=value" for one series.
  const COUNTERS = {
    routes: 'kvmesh_router_routes_total',
    prompt: 'kvmesh_router_prompt_tokens_total',
    predicted: 'kvmesh_router_predicted_cached_tokens_total',
    actual: 'kvmesh_router_actual_cached_tokens_total',
    degradations: 'kvmesh_router_degradations_total',
  };

  // ---- Prometheus text format --------------------------------------------

  // parseMetrics reads Prometheus text exposition into a Map from metric name
  // to its samples [{labels, value}]. Only names starting with prefix are
  // kept (the Go runtime's series are most of the text). Malformed lines are
  // skipped, never thrown on.
  function parseMetrics(text, prefix = 'kvmesh_') {
    const out = new Map();
    for (const raw of text.split('\n')) {
      const line = raw.trim();
      if (!line.startsWith(prefix)) continue; // also skips # HELP / # TYPE
      const s = parseSample(line);
      if (!s) continue;
      let list = out.get(s.name);
      if (!list) out.set(s.name, (list = []));
      list.push({ labels: s.labels, value: s.value });
    }
    return out;
  }

  function parseSample(line) {
    let i = 0;
    while (i < line.length && /[A-Za-z0-9_:]/.test(line[i])) i++;
    const name = line.slice(0, i);
    if (!name) return null;
    const labels = {};
    if (line[i] === '{') {
      i++;
      for (;;) {
        while (line[i] === ' ' || line[i] === ',') i++;
        if (line[i] === '}') { i++; break; }
        const eq = line.indexOf('=', i);
        if (eq < 0 || line[eq + 1] !== '"') return null;
        const key = line.slice(i, eq).trim();
        let j = eq + 2;
        let val = '';
        for (; j < line.length && line[j] !== '"'; j++) {
          if (line[j] === '\\' && j + 1 < line.length) {
            j++;
            val += line[j] === 'n' ? '\n' : line[j];
          } else {
            val += line[j];
          }
        }
        if (j >= line.length) return null;
        labels[key] = val;
        i = j + 1;
      }
    }
    const rest = line.slice(i).trim().split(/\s+/);
    if (!rest[0]) return null;
    const value = parseValue(rest[0]);
    if (value === null) return null;
    return { name, labels, value };
  }

  function parseValue(s) {
    if (s === '+Inf') return Infinity;
    if (s === '-Inf') return -Infinity;
    if (s === 'NaN') return NaN;
    const v = Number(s);
    return Number.isNaN(v) ? null : v;
  }

  // sum adds every series of a metric; undefined when the router lacks it.
  function sum(metrics, name) {
    const list = metrics.get(name);
    if (!list) return undefined;
    return list.reduce((a, s) => a + (Number.isFinite(s.value) ? s.value : 0), 0);
  }

  // ---- history -------------------------------------------------------------

  // Each sample keeps counters made monotonic across router restarts (a
  // counter that went down restarted from zero), so the increase over any
  // window is a subtraction.
  const history = [];
  let lastRaw = null;

  function record(t, metrics, replicas) {
    const raw = {};
    for (const [k, name] of Object.entries(COUNTERS)) raw[k] = sum(metrics, name);
    const prev = history[history.length - 1];
    const mono = {};
    for (const k of Object.keys(COUNTERS)) {
      const cur = raw[k];
      if (cur === undefined) { mono[k] = undefined; continue; }
      const before = prev && prev.c[k] !== undefined ? prev.c[k] : 0;
      const last = lastRaw && lastRaw[k] !== undefined ? lastRaw[k] : undefined;
      const inc = last === undefined ? 0 : cur >= last ? cur - last : cur;
      mono[k] = prev ? before + inc : 0;
    }
    lastRaw = raw;
    const online = replicas.filter((r) => r.online).length;
    const selected = replicas.filter((r) => r.online && r.selected).length;
    const degradedGauge = sum(metrics, 'kvmesh_router_degraded');
    const degraded = degradedGauge !== undefined ? degradedGauge > 0 : replicas.some((r) => r.routing_degraded);
    history.push({ t, c: mono, raw, online, selected, total: replicas.length, degraded });
    while (history.length > 2 && history[1].t < t - HISTORY_MS - HIT_WINDOW_MS) history.shift();
  }

  // sampleAt returns the oldest sample no older than t - ms before index i.
  function windowStart(i, ms) {
    const end = history[i].t;
    let j = i;
    while (j > 0 && history[j - 1].t >= end - ms) j--;
    return history[j];
  }

  function increase(a, b, k) {
    if (a.c[k] === undefined || b.c[k] === undefined) return undefined;
    return b.c[k] - a.c[k];
  }

  function hitRates(i) {
    const b = history[i];
    const a = windowStart(i, HIT_WINDOW_MS);
    const prompt = increase(a, b, 'prompt');
    if (!prompt) return { actual: null, predicted: null };
    return {
      actual: clamp01(increase(a, b, 'actual') / prompt),
      predicted: clamp01(increase(a, b, 'predicted') / prompt),
    };
  }

  function perSecond(i, k) {
    const b = history[i];
    const a = windowStart(i, RATE_WINDOW_MS);
    const inc = increase(a, b, k);
    if (inc === undefined || b.t === a.t) return null;
    return inc / ((b.t - a.t) / 1000);
  }

  function clamp01(x) {
    return Number.isFinite(x) ? Math.min(1, Math.max(0, x)) : null;
  }

  // ---- formatting ------------------------------------------------------------

  const intFmt = new Intl.NumberFormat('en-US');
  const compactFmt = new Intl.NumberFormat('en-US', { notation: 'compact', maximumFractionDigits: 1 });

  function pct(x) {
    return x === null || x === undefined ? '–' : (x * 100).toFixed(x >= 0.995 || x === 0 ? 0 : 1) + '%';
  }
  function count(x) {
    if (x === undefined || x === null) return '–';
    return x >= 100000 ? compactFmt.format(x) : intFmt.format(Math.round(x));
  }
  function rate(x) {
    if (x === null || x === undefined) return '–';
    if (x >= 1000) return compactFmt.format(x);
    return x >= 10 ? x.toFixed(0) : x.toFixed(1);
  }
  function age(ms) {
    if (!ms && ms !== 0) return '–';
    if (ms < 1000) return Math.round(ms) + ' ms';
    if (ms < 60000) return (ms / 1000).toFixed(1) + ' s';
    if (ms < 3600000) return Math.round(ms / 60000) + ' min';
    return (ms / 3600000).toFixed(1) + ' h';
  }

  // ---- charts ----------------------------------------------------------------

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  // drawChart draws series [{points:[[t,v]...], color, fill}] over the
  // history so far (at least a minute, at most HISTORY_MS, so a fresh page
  // already shows a line); yMax fixes the scale (hit rates), otherwise it
  // follows the data.
  function drawChart(canvas, series, yMax) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(canvas.clientWidth * dpr));
    const h = Math.max(1, Math.round(canvas.clientHeight * dpr));
    if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
    const ctx = canvas.getContext('2d');
    ctx.clearRect(0, 0, w, h);
    const now = history.length ? history[history.length - 1].t : Date.now();
    const first = history.length ? history[0].t : now;
    const span = Math.min(HISTORY_MS, Math.max(60 * 1000, now - first));
    const t0 = now - span;
    let max = yMax;
    if (max === undefined) {
      max = 0;
      for (const s of series) for (const [, v] of s.points) if (v !== null && v > max) max = v;
      max = max > 0 ? max * 1.15 : 1;
    }
    const pad = 3 * dpr;
    const x = (t) => ((t - t0) / span) * (w - 2 * pad) + pad;
    const y = (v) => h - pad - (v / max) * (h - 2 * pad);

    // baseline
    ctx.strokeStyle = cssVar('--line');
    ctx.lineWidth = dpr;
    ctx.beginPath();
    ctx.moveTo(pad, h - pad + 0.5);
    ctx.lineTo(w - pad, h - pad + 0.5);
    ctx.stroke();

    for (const s of series) {
      // Split into runs without gaps (null = no data, e.g. no traffic yet).
      const runs = [];
      let run = [];
      for (const [t, v] of s.points) {
        if (t < t0) continue;
        if (v === null || v === undefined) { if (run.length) runs.push(run); run = []; continue; }
        run.push([x(t), y(v)]);
      }
      if (run.length) runs.push(run);
      for (const r of runs) {
        if (s.fill) {
          ctx.beginPath();
          ctx.moveTo(r[0][0], h - pad);
          for (const [px, py] of r) ctx.lineTo(px, py);
          ctx.lineTo(r[r.length - 1][0], h - pad);
          ctx.closePath();
          ctx.globalAlpha = 0.14;
          ctx.fillStyle = s.color;
          ctx.fill();
          ctx.globalAlpha = 1;
        }
        ctx.beginPath();
        r.forEach(([px, py], k) => (k ? ctx.lineTo(px, py) : ctx.moveTo(px, py)));
        ctx.strokeStyle = s.color;
        ctx.lineWidth = 1.6 * dpr;
        ctx.lineJoin = 'round';
        ctx.stroke();
      }
      const last = runs.length ? runs[runs.length - 1] : null;
      if (last && s.dot !== false) {
        const [px, py] = last[last.length - 1];
        ctx.beginPath();
        ctx.arc(px, py, 2.6 * dpr, 0, 2 * Math.PI);
        ctx.fillStyle = s.color;
        ctx.fill();
      }
    }
  }

  function seriesOf(fn) {
    return history.map((s, i) => [s.t, fn(s, i)]);
  }

  function drawCharts() {
    const c1 = cssVar('--chart-1');
    const c2 = cssVar('--chart-2');
    const warn = cssVar('--warn');
    drawChart(byId('chart-selected'), [
      { points: seriesOf((s) => s.online), color: c2, dot: false },
      { points: seriesOf((s) => s.selected), color: c1, fill: true },
    ]);
    drawChart(byId('chart-rate'), [{ points: seriesOf((s, i) => perSecond(i, 'routes')), color: c1, fill: true }]);
    const hits = history.map((_, i) => hitRates(i));
    drawChart(byId('chart-hit'), [
      { points: history.map((s, i) => [s.t, hits[i].predicted]), color: c2 },
      { points: history.map((s, i) => [s.t, hits[i].actual]), color: c1, fill: true },
    ], 1);
    drawChart(byId('chart-saved'), [{ points: seriesOf((s, i) => perSecond(i, 'actual')), color: c1, fill: true }]);
    drawChart(byId('chart-degr'), [
      { points: seriesOf((s) => (s.degraded ? 1 : 0)), color: warn, fill: true, dot: false },
    ], 1);
  }

  // ---- DOM -------------------------------------------------------------------

  function byId(id) {
    return document.getElementById(id);
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function setText(id, text) {
    const e = byId(id);
    if (e.textContent !== text) e.textContent = text;
  }

  function renderSummary(replicas) {
    const i = history.length - 1;
    const s = history[i];
    setText('selected-count', String(s.selected));
    setText('online-count', String(s.online));
    const unselected = replicas.filter((r) => r.online && !r.selected).length;
    const offline = s.total - s.online;
    const parts = [];
    if (unselected) parts.push(unselected + ' balanced by load only');
    if (offline) parts.push(offline + ' offline');
    setText('selected-note', parts.length ? parts.join(' · ') : 'replicas selected for prefix matching');

    setText('req-rate', rate(perSecond(i, 'routes')));
    setText('req-total', count(s.raw.routes));

    const hr = hitRates(i);
    setText('hit-actual', pct(hr.actual));
    setText('hit-predicted', pct(hr.predicted));
    if (s.raw.prompt === undefined) {
      setText('hit-note', 'this router does not export kvmesh_router_prompt_tokens_total');
    } else if (hr.actual === null) {
      setText('hit-note', 'no traffic in the last 30 s');
    } else {
      setText('hit-note', 'share of prompt tokens found in the engines\u2019 KV cache');
    }

    setText('saved-total', count(s.raw.actual));
    setText('saved-rate', rate(perSecond(i, 'actual')));

    setText('degr-total', count(s.raw.degradations));
    setText('degr-note', s.degraded ? 'degraded now: routing by least load' : 'switches to least-load routing');
    byId('card-degr').classList.toggle('alert', s.degraded);
    byId('degraded-banner').hidden = !s.degraded;
  }

  const rows = new Map(); // replica name → {tr, cells}

  function naturalCompare(a, b) {
    return a.localeCompare(b, undefined, { numeric: true, sensitivity: 'base' });
  }

  function makeRow(name) {
    const tr = el('tr');
    tr.dataset.replica = name;
    const c = {};
    const add = (key, cls) => {
      const td = el('td', cls);
      tr.append(td);
      c[key] = td;
      return td;
    };
    const nameTd = add('name', 'name');
    c.nameText = el('strong', '', name);
    c.url = el('div', 'mono url');
    c.why = el('span', 'why', 'not selected · still receives traffic by load');
    nameTd.append(c.nameText, c.url, c.why);
    add('model', 'mono');
    add('protocol', 'col-protocol');
    c.status = el('span', 'pill');
    add('statusCell').append(c.status);
    c.sel = el('span', 'pill');
    add('selCell').append(c.sel);
    add('load', 'num');
    const kv = add('kv');
    c.bar = el('span', 'bar');
    c.barFill = el('span');
    c.bar.append(c.barFill);
    c.pct = el('span', 'pct');
    kv.append(c.bar, c.pct);
    const keys = add('keysCell', 'num');
    c.keys = el('span');
    c.gen = el('span', 'gen');
    keys.append(c.keys, c.gen);
    add('age', 'num');
    const btn = el('button', 'btn small danger', 'Clear');
    btn.type = 'button';
    btn.dataset.clear = name;
    btn.title = 'Forget which prompt prefixes ' + name + ' holds, on every router: its requests go by load ' +
      'until its sidecar republishes what the engine really caches (a few seconds)';
    btn.addEventListener('click', () => clearRoutes([name], btn));
    add('actions', 'actions').append(btn);
    c.btn = btn;
    return { tr, c };
  }

  function renderReplicas(replicas) {
    const tbody = byId('replica-rows');
    const empty = tbody.querySelector('tr.empty');
    if (!replicas.length) {
      for (const { tr } of rows.values()) tr.remove();
      rows.clear();
      if (!empty) {
        const tr = el('tr', 'empty');
        const td = el('td', '', 'No replicas known yet: start a sidecar that joins this router.');
        td.colSpan = 10;
        tr.append(td);
        tbody.append(tr);
      } else {
        empty.firstElementChild.textContent = 'No replicas known yet: start a sidecar that joins this router.';
      }
      return;
    }
    if (empty) empty.remove();
    const seen = new Set();
    const sorted = [...replicas].sort((a, b) => naturalCompare(a.name, b.name));
    let prev = null;
    for (const r of sorted) {
      seen.add(r.name);
      let row = rows.get(r.name);
      if (!row) {
        row = makeRow(r.name);
        rows.set(r.name, row);
      }
      // Keep DOM order sorted without re-creating rows (buttons keep focus).
      const want = prev ? prev.nextSibling : tbody.firstChild;
      if (row.tr !== want) tbody.insertBefore(row.tr, want);
      prev = row.tr;
      updateRow(row, r);
    }
    for (const [name, row] of rows) {
      if (!seen.has(name)) {
        row.tr.remove();
        rows.delete(name);
      }
    }
  }

  function updateRow({ tr, c }, r) {
    const selected = r.online && r.selected;
    tr.classList.toggle('unselected', !r.selected);
    tr.classList.toggle('offline', !r.online);
    // A data-parallel rank shares its server's URL with the other ranks.
    c.url.textContent = (r.url || '') + (r.data_parallel_rank != null ? ' · DP rank ' + r.data_parallel_rank : '') + (r.kv_role && r.kv_role !== 'both' ? ' · ' + r.kv_role : '');
    const models = r.models && r.models.length ? r.models : r.model ? [r.model] : [];
    c.model.textContent = models.length ? models[0] + (models.length > 1 ? ' +' + (models.length - 1) : '') : '–';
    c.model.title = models.join(', ');
    c.protocol.textContent = r.protocol || '–';

    let cls = 'pill ok';
    let text = 'online';
    let title = '';
    if (!r.online) { cls = 'pill bad'; text = 'offline'; } else if (r.ejected_ms > 0) {
      cls = 'pill bad'; text = 'ejected';
      title = 'failed to answer this router: out of its routing for ' + age(r.ejected_ms) + ' more';
    } else if (r.stale) { cls = 'pill warn'; text = 'stale'; }
    c.status.className = cls;
    c.status.textContent = text;
    c.status.title = title;

    if (!r.selected) {
      c.sel.className = 'pill plain';
      c.sel.textContent = 'load only';
    } else if (!r.kv_events) {
      c.sel.className = 'pill plain';
      c.sel.textContent = 'load only · no KV events';
    } else {
      c.sel.className = selected ? 'pill sel' : 'pill';
      c.sel.textContent = 'selected';
    }

    c.load.textContent = count(r.waiting) + ' / ' + count(r.running);
    const u = Math.min(1, Math.max(0, Number(r.kv_usage) || 0));
    c.barFill.style.width = (u * 100).toFixed(1) + '%';
    c.bar.className = 'bar' + (u >= 0.9 ? ' high' : u >= 0.7 ? ' mid' : '');
    c.pct.textContent = pct(u);

    c.keys.textContent = count(r.filter_keys);
    c.gen.textContent = 'gen ' + r.filter_generation;
    c.keysCell.title = 'exact resident block keys in filter generation ' + r.filter_generation;
    c.age.textContent = age(r.state_age_ms);
    c.age.title = 'time since this replica\u2019s state last reached this router';
  }

  // ---- clearing route records -------------------------------------------------

  function toast(msg, bad, ms = 4000) {
    const t = el('div', 'toast' + (bad ? ' bad' : ''), msg);
    byId('toasts').append(t);
    setTimeout(() => t.remove(), ms);
  }

  // clearedMessage says what a clear dropped and what happens next, from
  // the router's answer ({cleared, replicas: [{name, filter_keys,
  // kv_events}], filter_keys}).
  function clearedMessage(label, out) {
    const done = 'Route records cleared for ' + label;
    if (!out || !Array.isArray(out.replicas)) return done + '.'; // a router that answers less
    const reps = out.replicas;
    const keys = out.filter_keys || 0;
    const fed = reps.filter((r) => r.kv_events).length;
    const one = reps.length === 1;
    const msg = done + ' on every router: ' + count(keys) + (keys === 1 ? ' filter key' : ' filter keys') +
      ' dropped here' + (one ? '' : ' over ' + reps.length + ' replicas') + '. ';
    if (fed === 0) {
      return msg + 'No sidecar feeds ' + (one ? 'it' : 'them') +
        ': only the records of what was routed there are gone, and routing stays by load.';
    }
    let who = 'Requests to each of the ' + fed + ' with a sidecar are';
    if (one) who = 'Its requests are';
    else if (fed === reps.length) who = 'Requests to each are';
    else if (fed === 1) who = 'Requests to the one with a sidecar are';
    return msg + who + ' routed by load until its sidecar publishes a fresh filter (a few seconds), ' +
      'then by prefix again, from what the engine really caches.';
  }

  function storedToken() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ''; } catch { return ''; }
  }
  function storeToken(tok) {
    try {
      if (tok) sessionStorage.setItem(TOKEN_KEY, tok); else sessionStorage.removeItem(TOKEN_KEY);
    } catch { /* storage disabled: the token lives for this prompt only */ }
  }

  // askToken opens the dialog and resolves with the token, or '' if cancelled.
  function askToken(rejected) {
    const dlg = byId('token-dialog');
    const input = byId('token-input');
    byId('token-error').hidden = !rejected;
    input.value = '';
    return new Promise((resolve) => {
      const done = (tok) => {
        form.removeEventListener('submit', onSubmit);
        cancel.removeEventListener('click', onCancel);
        dlg.removeEventListener('cancel', onCancel);
        if (dlg.open) dlg.close();
        resolve(tok);
      };
      const form = byId('token-form');
      const cancel = byId('token-cancel');
      const onSubmit = (e) => { e.preventDefault(); done(input.value.trim()); };
      const onCancel = (e) => { e.preventDefault(); done(''); };
      form.addEventListener('submit', onSubmit);
      cancel.addEventListener('click', onCancel);
      dlg.addEventListener('cancel', onCancel);
      dlg.showModal();
      input.focus();
    });
  }

  async function clearRoutes(names, btn) {
    const label = names.length ? names.join(', ') : 'all replicas';
    btn.disabled = true;
    try {
      let token = storedToken();
      let rejected = false;
      for (let attempt = 0; attempt < 4; attempt++) {
        const headers = { 'Content-Type': 'application/json' };
        if (token) headers.Authorization = 'Bearer ' + token;
        const res = await fetch('/admin/routes/clear', {
          method: 'POST', headers, cache: 'no-store',
          body: JSON.stringify(names.length ? { replicas: names } : {}),
        });
        if (res.status === 401) {
          if (token) { rejected = true; storeToken(''); }
          token = await askToken(rejected);
          if (!token) { toast('Not cleared: the router needs its admin token.', true); return; }
          continue;
        }
        if (!res.ok) {
          let msg = res.status + ' ' + res.statusText;
          try { msg = (await res.json()).error.message || msg; } catch { /* not JSON */ }
          toast('Clearing failed: ' + msg, true);
          return;
        }
        if (token) storeToken(token);
        let out = null;
        try { out = await res.json(); } catch { /* an older router answers less */ }
        const msg = clearedMessage(label, out);
        toast(msg, false, 10000);
        // Kept beside the button after the toast is gone: what the last
        // clear did, for whoever looks at the page next.
        const last = byId('clear-last');
        last.textContent = 'Last clear, at ' + new Date().toLocaleTimeString() + ': ' + msg;
        last.hidden = false;
        schedule(150); // show the rebuilt filters soon
        return;
      }
      toast('Not cleared: the token was rejected.', true);
    } catch (e) {
      toast('Clearing failed: ' + e.message, true);
    } finally {
      btn.disabled = false;
    }
  }

  function setupClearAll() {
    const btn = byId('clear-all');
    const idle = btn.textContent;
    let timer = 0;
    const disarm = () => { clearTimeout(timer); btn.classList.remove('armed'); btn.textContent = idle; };
    // Two clicks: clearing every replica sends all traffic cold for a moment.
    btn.addEventListener('click', () => {
      if (!btn.classList.contains('armed')) {
        btn.classList.add('armed');
        btn.textContent = btn.dataset.confirm;
        timer = setTimeout(disarm, 4000);
        return;
      }
      disarm();
      clearRoutes([], btn);
    });
  }

  // ---- tenants -----------------------------------------------------------------

  // renderTenants lists every tenant the router's metrics name: requests
  // held now by priority, tokens served, and what was turned away and why.
  function renderTenants(metrics) {
    const rows = new Map();
    const row = (t) => rows.get(t) || rows.set(t, { held: { critical: 0, standard: 0, sheddable: 0 }, tokens: 0 }).get(t);
    for (const s of metrics.get('kvmesh_router_queue_depth') || []) {
      if (s.labels.tenant && s.labels.priority in row(s.labels.tenant).held) row(s.labels.tenant).held[s.labels.priority] += s.value;
    }
    for (const s of metrics.get('kvmesh_router_tenant_tokens_total') || []) {
      if (s.labels.tenant) row(s.labels.tenant).tokens += s.value;
    }
    const body = byId('tenant-rows');
    if (rows.size) {
      body.replaceChildren(...[...rows.keys()].sort(naturalCompare).map((name) => {
        const r = rows.get(name);
        const tr = el('tr');
        tr.append(el('td', '', name), el('td', 'num', [r.held.critical, r.held.standard, r.held.sheddable].map(count).join(' / ')),
          el('td', 'num', count(r.tokens)));
        return tr;
      }));
    }
    const rejected = (metrics.get('kvmesh_router_rejected_total') || []).filter((s) => s.value > 0)
      .map((s) => s.labels.reason + ' ' + count(s.value));
    setText('rejected-note', rejected.length ? 'Turned away since start: ' + rejected.join(', ') + '.' : '');
  }

  // ---- polling -----------------------------------------------------------------

  const state = { polls: 0, errors: 0, lastError: '', timer: 0, inFlight: false };

  function setLive(kind, text) {
    const live = byId('live');
    live.dataset.state = kind;
    setText('live-text', text);
  }

  async function getOK(url, as) {
    const res = await fetch(url, { cache: 'no-store', signal: AbortSignal.timeout(FETCH_TIMEOUT_MS) });
    if (!res.ok) throw new Error(url + ': ' + res.status);
    return as === 'json' ? res.json() : res.text();
  }

  async function poll() {
    if (state.inFlight) return;
    state.inFlight = true;
    try {
      const [replicas, text] = await Promise.all([getOK('/admin/replicas', 'json'), getOK('/metrics', 'text')]);
      const list = Array.isArray(replicas) ? replicas : [];
      const metrics = parseMetrics(text);
      record(Date.now(), metrics, list);
      renderSummary(list);
      renderReplicas(list);
      renderTenants(metrics);
      drawCharts();
      state.polls++;
      setLive('live', 'live · ' + new Date().toLocaleTimeString([], { hour12: false }));
    } catch (e) {
      state.errors++;
      state.lastError = String(e && e.message ? e.message : e);
      setLive('error', 'router unreachable · retrying');
    } finally {
      state.inFlight = false;
    }
  }

  function schedule(ms) {
    clearTimeout(state.timer);
    if (document.hidden) { setLive('paused', 'paused while hidden'); return; }
    state.timer = setTimeout(async () => {
      await poll();
      schedule(POLL_MS);
    }, ms);
  }

  function start() {
    setText('router-host', location.host);
    setupClearAll();
    document.addEventListener('visibilitychange', () => schedule(0));
    let resize = 0;
    window.addEventListener('resize', () => {
      clearTimeout(resize);
      resize = setTimeout(() => history.length && drawCharts(), 100);
    });
    schedule(0);
  }

  // A small read-only handle for the browser test and for the curious.
  window.kvmeshConsole = {
    state,
    parseMetrics,
    hitRate: () => (history.length ? hitRates(history.length - 1) : null),
  };

  start();
})();
