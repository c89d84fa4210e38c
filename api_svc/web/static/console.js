// The MARLaaS web console (api_svc/web/): a tenant's jobs, curves and episodes, live.
//
// The API key is asked for once and kept in this tab's sessionStorage; every request sends
// it as `Authorization: Bearer` to this server's JSON routes, and an answer that comes back
// after the key changed (signed out meanwhile) is dropped. Text from the server is only ever
// set as text (textContent), never parsed as markup; the charts, the report's SVG, are parsed
// into a detached document (which runs no script) and taken only when they are SVG.
"use strict";

const KEY_SLOT = "marlaas.console.key";
const REFRESH_MS = 5000;
const SAMPLES_EVERY = 3; // refreshes between two reloads of the selected job's episodes
const SAMPLES_SHOWN = 4;
const NOTICE_MS = 8000;
const SVG = "http://www.w3.org/2000/svg";
const SPECIAL_TOKEN = /<\|[^|<>]{1,40}\|>/;
const ACTIONS = {
  pending: ["cancel"],
  running: ["pause", "cancel"],
  paused: ["resume", "cancel"],
};

const view = {
  jobs: [],
  charts: { jobs: {}, left_out: 0 },
  selected: null,
  refreshes: 0,
  timer: null,
  refreshing: false,
  refreshAgain: false,
  noticeUntil: 0,
  busy: new Set(), // jobs with a command in flight
};

const $ = (id) => document.getElementById(id);

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

// --- the API ---------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }

  get quiet() {
    return this.status === 401 || this.status === STALE; // signed out: nothing to say
  }
}

const STALE = -1; // an ApiError's status: the answer to a key no longer signed in

async function api(path, options = {}) {
  const key = sessionStorage.getItem(KEY_SLOT);
  const response = await fetch(path, {
    method: options.method || "GET",
    headers: { Authorization: `Bearer ${key}` },
    cache: "no-store",
    credentials: "omit",
  });
  if (sessionStorage.getItem(KEY_SLOT) !== key) throw new ApiError(STALE, "signed out meanwhile");
  if (response.status === 401) {
    signOut("The API key is not valid any more (revoked, or its tenant revoked).");
    throw new ApiError(401, "signed out");
  }
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try {
      const body = await response.json();
      message = body.error || body.detail || message;
    } catch (_) {
      // not JSON: the status says enough
    }
    throw new ApiError(response.status, typeof message === "string" ? message : JSON.stringify(message));
  }
  return options.raw ? response : response.json();
}

// --- signing in and out ----------------------------------------------------------------

async function signIn(event) {
  event.preventDefault();
  const input = $("key-input");
  const key = input.value.trim();
  $("sign-in-error").textContent = "";
  if (!key) return;
  sessionStorage.setItem(KEY_SLOT, key);
  input.value = "";
  try {
    await start();
  } catch (error) {
    sessionStorage.removeItem(KEY_SLOT);
    showSignIn(error.status === 401 ? "That key is not valid." : `Cannot sign in: ${error.message}`);
  }
}

// Nothing of the tenant stays on the page, hidden or not, for whoever signs in next.
function signOut(message) {
  sessionStorage.removeItem(KEY_SLOT);
  clearTimeout(view.timer);
  Object.assign(view, { jobs: [], charts: { jobs: {}, left_out: 0 }, selected: null, refreshes: 0 });
  $("jobs-body").replaceChildren();
  $("tenant-name").textContent = "";
  $("samples-job").textContent = "";
  $("samples").replaceChildren(element("p", "empty", "Choose a job to see its latest episodes."));
  for (const holder of document.querySelectorAll(".chart-holder")) holder.replaceChildren();
  delete document.body.dataset.refreshes;
  notice("");
  showSignIn(message || "");
}

function showSignIn(message) {
  $("console-view").hidden = true;
  $("session").hidden = true;
  $("sign-in-view").hidden = false;
  $("sign-in-error").textContent = message;
  $("key-input").focus();
}

async function start() {
  const tenant = await api("/v1/tenant");
  $("tenant-name").textContent = `tenant ${tenant.tenant}`;
  $("sign-in-view").hidden = true;
  $("session").hidden = false;
  $("console-view").hidden = false;
  await refresh();
}

// --- the live view ---------------------------------------------------------------------

// One refresh at a time: asked for during one (a command done), another follows it.
async function refresh() {
  if (view.refreshing) {
    view.refreshAgain = true;
    return;
  }
  view.refreshing = true;
  clearTimeout(view.timer);
  try {
    await refreshOnce();
  } finally {
    view.refreshing = false;
  }
  if (!sessionStorage.getItem(KEY_SLOT)) return; // signed out meanwhile
  if (view.refreshAgain) {
    view.refreshAgain = false;
    await refresh();
    return;
  }
  view.timer = setTimeout(refresh, REFRESH_MS);
}

async function refreshOnce() {
  try {
    view.jobs = await api("/v1/jobs");
    view.jobs.sort((a, b) => b.created_at - a.created_at);
    if (!view.selected && view.jobs.length) view.selected = view.jobs[0].job_id;
    renderJobs();
    view.charts = await api("/console/charts");
    renderCharts();
    renderJobs(); // the rewards and colours the charts brought
    if (view.selected && view.refreshes % SAMPLES_EVERY === 0) await loadSamples();
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    if (Date.now() > view.noticeUntil) notice("");
    view.refreshes += 1;
    document.body.dataset.refreshes = String(view.refreshes);
  } catch (error) {
    if (!error.quiet) notice(`Could not refresh: ${error.message}`, true);
  }
}

// A message above the jobs, kept at least NOTICE_MS, then cleared by a good refresh.
function notice(message, bad) {
  view.noticeUntil = Date.now() + NOTICE_MS;
  const box = $("notice");
  box.textContent = message;
  box.classList.toggle("bad", Boolean(bad));
  box.hidden = !message;
}

function seriesColour(jobId) {
  const path = document.querySelector(
    `[data-chart-card="reward"] path[data-series="${CSS.escape(jobId)}"]`,
  );
  return path ? path.getAttribute("stroke") : null;
}

function renderJobs() {
  const body = $("jobs-body");
  body.replaceChildren(...view.jobs.map(jobRow));
  $("jobs-empty").hidden = view.jobs.length > 0;
  $("jobs-table").hidden = view.jobs.length === 0;
  const older = view.charts.left_out ? ` · ${view.charts.left_out} older not charted` : "";
  $("jobs-count").textContent = `${view.jobs.length} job${view.jobs.length === 1 ? "" : "s"}${older}`;
}

function jobRow(job) {
  const row = element("tr");
  row.dataset.job = job.job_id;
  row.classList.toggle("selected", job.job_id === view.selected);
  row.addEventListener("click", () => selectJob(job.job_id));

  const name = element("td");
  const swatch = element("span", "swatch");
  const colour = seriesColour(job.job_id);
  if (colour) swatch.style.background = colour;
  name.append(swatch, element("span", "job-id", job.job_id));
  name.append(element("div", "job-env", job.env ? `env ${job.env}` : ""));

  const state = element("td");
  const badge = element("span", `state ${job.status}`, job.status);
  badge.dataset.field = "state";
  state.append(badge);
  if (job.reason) state.title = job.reason;

  const progress = element("td");
  const bar = element("div", "progress");
  const track = element("div", "track");
  const fill = element("div", "fill");
  const share = job.max_steps ? Math.min(1, job.version / job.max_steps) : 0;
  fill.style.width = `${(share * 100).toFixed(1)}%`;
  track.append(fill);
  bar.append(track, element("span", "steps", `${job.version} / ${job.max_steps || "?"}`));
  progress.append(bar);

  const numbers = view.charts.jobs[job.job_id] || {};
  const reward = element("td", "num", formatNumber(numbers.last_reward));
  reward.dataset.field = "last_reward";
  const heldOut = element("td", "num", heldOutText(job));
  heldOut.dataset.field = "held_out";

  const created = element("td", "muted", ago(job.created_at));
  created.title = new Date(job.created_at * 1000).toLocaleString();

  const actions = element("td", "actions");
  for (const action of ACTIONS[job.status] || []) {
    const button = element("button", `button small${action === "cancel" ? " danger" : ""}`, label(action));
    button.type = "button";
    button.dataset.action = action;
    button.disabled = view.busy.has(job.job_id);
    button.addEventListener("click", (event) => {
      event.stopPropagation();
      command(job, action);
    });
    actions.append(button);
  }
  if (job.version > 0) {
    const button = element("button", "button small", "Export");
    button.type = "button";
    button.dataset.action = "export";
    button.title = `Download adapter v${job.version} as .tar.gz`;
    button.addEventListener("click", (event) => {
      event.stopPropagation();
      download(`/v1/jobs/${encodeURIComponent(job.job_id)}/export`, `${job.job_id}.tar.gz`, button);
    });
    actions.append(button);
  }
  row.append(name, state, progress, reward, heldOut, created, actions);
  return row;
}

function label(action) {
  return action.charAt(0).toUpperCase() + action.slice(1);
}

function heldOutText(job) {
  const versions = Object.keys(job.evals || {}).map(Number).sort((a, b) => a - b);
  if (!versions.length) return "–";
  const latest = versions[versions.length - 1];
  const accuracy = job.evals[String(latest)].eval_accuracy;
  return `${formatNumber(accuracy)} · v${latest}`;
}

function formatNumber(value) {
  return typeof value === "number" && Number.isFinite(value) ? value.toFixed(3) : "–";
}

function ago(seconds) {
  if (!seconds) return "–";
  const passed = Math.max(0, Date.now() / 1000 - seconds);
  if (passed < 60) return `${Math.round(passed)} s ago`;
  if (passed < 3600) return `${Math.round(passed / 60)} min ago`;
  if (passed < 86400) return `${Math.round(passed / 3600)} h ago`;
  return `${Math.round(passed / 86400)} d ago`;
}

function renderCharts() {
  for (const [chart, markup] of Object.entries(view.charts.charts || {})) {
    const holder = document.querySelector(`[data-chart-card="${chart}"] .chart-holder`);
    if (!holder) continue;
    // Parsed as HTML, as the report's page has it inline (an HTML parser puts <svg> in the
    // SVG namespace); a parsed document runs no script.
    const parsed = new DOMParser().parseFromString(markup, "text/html").body.firstElementChild;
    if (!parsed || parsed.namespaceURI !== SVG) continue; // not an SVG: keep the last good one
    holder.replaceChildren(document.importNode(parsed, true));
  }
}

// --- commands and downloads ------------------------------------------------------------

async function command(job, action) {
  if (action === "cancel" && !window.confirm(`Cancel job ${job.job_id}? It cannot be resumed.`)) return;
  view.busy.add(job.job_id);
  renderJobs();
  notice(`${label(action)} of ${job.job_id} sent; waiting for it to apply…`);
  try {
    const done = await api(`/v1/jobs/${encodeURIComponent(job.job_id)}/${action}`, { method: "POST" });
    notice(`${job.job_id} is ${done.status}.`);
  } catch (error) {
    if (!error.quiet) notice(`${label(action)} of ${job.job_id} failed: ${error.message}`, true);
  } finally {
    view.busy.delete(job.job_id);
  }
  await refresh();
}

async function download(path, fallbackName, button) {
  if (button) button.disabled = true;
  try {
    const response = await api(path, { raw: true });
    const disposition = response.headers.get("Content-Disposition") || "";
    const named = /filename="([^"]+)"/.exec(disposition);
    const blob = await response.blob();
    const link = element("a");
    link.href = URL.createObjectURL(blob);
    link.download = named ? named[1] : fallbackName;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 60000);
  } catch (error) {
    if (!error.quiet) notice(`Download failed: ${error.message}`, true);
  } finally {
    if (button) button.disabled = false;
  }
}

// --- episode samples -------------------------------------------------------------------

async function selectJob(jobId) {
  view.selected = jobId;
  renderJobs();
  await loadSamples();
}

async function loadSamples() {
  const jobId = view.selected;
  $("samples-job").textContent = jobId ? `· ${jobId}` : "";
  const holder = $("samples");
  try {
    const episodes = await api(`/v1/jobs/${encodeURIComponent(jobId)}/episodes?limit=${SAMPLES_SHOWN}`);
    if (jobId !== view.selected) return; // another job was chosen meanwhile
    if (!episodes.length) {
      holder.replaceChildren(element("p", "empty", "No recent finished episode of this job."));
    } else {
      holder.replaceChildren(...episodes.map(episodeCard));
    }
  } catch (error) {
    if (!error.quiet) holder.replaceChildren(element("p", "empty", `Episodes unavailable: ${error.message}`));
  }
}

function episodeCard(episode) {
  const card = element("article", "episode");
  card.dataset.episode = episode.episode_id;
  const head = element("div", "episode-head");
  const reward = element("span", `reward${episode.reward === null ? " none" : ""}`);
  reward.textContent = episode.reward === null ? "no reward" : `reward ${formatNumber(episode.reward)}`;
  reward.dataset.field = "reward";
  const components = element("div", "components");
  for (const [name, value] of Object.entries(episode.reward_components)) {
    const kind = value === null ? " none" : value === 0 ? " zero" : "";
    const chip = element("span", `chip${kind}`, `${name} ${formatNumber(value)}`);
    chip.dataset.component = name;
    components.append(chip);
  }
  const versions = [...new Set(episode.adapter_versions)].map((v) => `v${v}`).join(", ");
  head.append(
    reward,
    components,
    element("span", "muted", [`adapter ${versions || "–"}`, `${episode.tokens} tokens`, ago(episode.finished_at)].join(" · ")),
    element("span", "episode-id", episode.episode_id),
  );
  card.append(head);
  if (episode.error) card.append(element("p", "episode-error", episode.error));
  let calledTools = false;
  episode.turns.forEach((turn, index) => {
    if (index === 1 && episode.turns_left_out) {
      card.append(element("p", "empty", `… ${episode.turns_left_out} turns left out …`));
    }
    card.append(turnBlock(turn, calledTools));
    calledTools = turn.source === "model" && turn.tool_calls.length > 0;
  });
  return card;
}

function turnBlock(turn, answersToolCalls) {
  const block = element("div", `turn turn-${turn.source}`);
  block.dataset.source = turn.source;
  const names = {
    prompt: "Prompt",
    model: "Model",
    environment: answersToolCalls ? "Tool result" : "Environment",
  };
  const body = element("div", "turn-body");
  const text = templateText(turn.text);
  if (turn.source === "prompt") {
    const details = element("details");
    const summary = element("summary", null, `${turn.tokens} tokens${turn.clipped ? ", its end shown" : ""}`);
    summary.append(element("span", "preview", promptPreview(turn.text)));
    details.append(summary, text);
    body.append(details);
  } else {
    body.append(text);
  }
  for (const call of turn.tool_calls || []) {
    const shown = element("div", `tool-call${call.name ? "" : " malformed"}`);
    shown.dataset.tool = call.name;
    shown.append(element("span", "tool-name", call.name ? `→ ${call.name}` : "malformed call"));
    shown.append(element("span", "tool-args", call.arguments));
    body.append(shown);
  }
  block.append(element("div", "turn-label", names[turn.source]), body);
  return block;
}

// The prompt's last message, for its folded view: the text after the template's last
// special token that says more than a role name, without that role line.
function promptPreview(text) {
  const pieces = text
    .split(SPECIAL_TOKEN)
    .map((piece) => piece.trim())
    .filter((piece) => piece && !/^\w+$/.test(piece));
  const last = (pieces[pieces.length - 1] || "").replace(/^\w+\n/, "").replace(/\s+/g, " ");
  return last.length > 160 ? `…${last.slice(-159)}` : last;
}

// The chat template's special tokens (<|im_start|>...) dimmed; everything as text.
function templateText(text) {
  const pre = element("pre");
  for (const part of text.split(new RegExp(`(${SPECIAL_TOKEN.source})`))) {
    if (!part) continue;
    pre.append(/^<\|.*\|>$/.test(part) ? element("span", "special", part) : document.createTextNode(part));
  }
  return pre;
}

// --- start -----------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut("Signed out."));
  $("report-button").addEventListener("click", (event) =>
    download("/v1/report", "report.tar.gz", event.currentTarget),
  );
  if (sessionStorage.getItem(KEY_SLOT)) {
    start().catch((error) => {
      if (!error.quiet) showSignIn(`Cannot reach the API: ${error.message}`);
    });
  } else {
    showSignIn("");
  }
});
