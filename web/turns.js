// The turns table: a row per turn, with what this page measured (web/client.js TurnStats: ms from
// the end of the user's turn as the page saw it) and then the server's record of the same turn
// (web/record.js turnFigures: docs/observability.md). Rows stay in turn order.
export function renderTurn(tbody, turn, s, figures) {
  let row = document.getElementById(`row-${turn}`);
  if (!row) {
    row = document.createElement("tr");
    row.id = `row-${turn}`;
    tbody.insertBefore(row, [...tbody.rows].find((r) => Number(r.id.slice(4)) > turn) || null);
  }
  const ms = (v) => (v == null ? "–" : `${Math.round(v)} ms`);
  const cells = s ? [ms(s.firstChunkMs), ms(s.firstPlayedMs), s.chunks > 1 ? ms(s.largestGapMs) : "–",
                     s.chunks, s.underruns, s.interrupted === null ? "…" : (s.interrupted ? "yes" : "no")] : Array(6).fill("–");
  row.innerHTML = [turn, ...cells].map((c) => `<td>${c}</td>`).join("") + recordCells(figures);
}

const escape = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

// The record's cells of a turns-table row (data-k names each; "–" where the record has no figure).
export function recordCells(f) {
  const ms = (v) => (v == null ? "–" : `${Math.round(v)} ms`);
  const air = !f || f.dead_air_ms == null ? "–" : f.dead_air_ms === 0 ? "0 ms"
    : `${f.dead_air_ms} ms (${Object.entries(f.causes).map(([c, v]) => `${escape(c)} ${v}`).join(", ")})`;
  const cells = [["stt", ms(f?.stt_final_ms)], ["v2v", ms(f?.voice_to_voice_ms)], ["llm", ms(f?.llm_first_token_ms)],
                 ["tts", ms(f?.tts_first_chunk_ms)], ["audio", ms(f?.first_audio_ms)], ["air", air]];
  return cells.map(([k, v]) => `<td class="rec" data-k="${k}">${v}</td>`).join("");
}
