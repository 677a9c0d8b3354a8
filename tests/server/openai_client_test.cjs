// The official `openai` npm client (tests/oracle/setup installs it into .cache/oracle) against a
// running `moraine serve`: models, chat and completions whole and streamed, usage, stop strings,
// log-probabilities, 16 concurrent requests, a follow-up that reuses the cached prefix, and the
// client's own error classes for a 404 and a 400.
//   node openai_client_test.cjs ORACLE_DIR BASE_URL MODEL API_KEY
'use strict';
const assert = require('node:assert/strict');
const path = require('node:path');
const { createRequire } = require('node:module');

const [oracleDir, baseURL, model, apiKey] = process.argv.slice(2);
const OpenAI = createRequire(path.join(oracleDir, 'package.json'))('openai').default;
const client = new OpenAI({ baseURL: baseURL + '/v1', apiKey, maxRetries: 0, timeout: 120000 });

const results = [];
async function check(name, fn) {
  const t0 = Date.now();
  await fn();
  results.push(name);
  console.log(`ok ${name} (${Date.now() - t0} ms)`);
}

// Greedy, a fixed length (ignore_eos is moraine's and llama.cpp's extension: a random test model
// may end early), so that every run of a request gives the same tokens.
const chatBody = (content, extra = {}) => ({
  model, messages: [{ role: 'user', content }], temperature: 0, max_tokens: 12, ignore_eos: true, ...extra,
});

async function streamText(body) {
  const stream = await client.chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, chunks = 0, role = null;
  for await (const c of stream) {
    chunks++;
    if (c.usage) usage = c.usage;
    if (!c.choices.length) continue;
    const ch = c.choices[0];
    if (ch.delta.role) role = ch.delta.role;
    if (ch.delta.content) text += ch.delta.content;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  return { text, finish, usage, chunks, role };
}

// A stop string that occurs first at a position >= 1 of `text`: three characters of ASCII where
// there are some, else any three.
function pickStop(text) {
  for (const ascii of [true, false]) {
    for (let i = 1; i + 3 <= text.length; i++) {
      const s = text.slice(i, i + 3);
      if (ascii && !/^[\x21-\x7e]{3}$/.test(s)) continue;
      if (text.indexOf(s) === i) return s;
    }
  }
  return null;
}

async function main() {
  let base;
  await check('models.list', async () => {
    const list = await client.models.list();
    const ids = list.data.map((m) => m.id);
    assert.deepEqual(ids, [model]);
  });
  await check('chat non-streaming: content, usage, ids', async () => {
    base = await client.chat.completions.create(chatBody('Tell me about glaciers.'));
    assert.match(base.id, /^chatcmpl-/);
    assert.equal(base.object, 'chat.completion');
    assert.equal(base.model, model);
    assert.ok(Math.abs(base.created - Date.now() / 1000) < 600);
    assert.equal(base.choices.length, 1);
    assert.equal(base.choices[0].message.role, 'assistant');
    assert.equal(typeof base.choices[0].message.content, 'string');
    assert.equal(base.choices[0].finish_reason, 'length');
    assert.equal(base.usage.completion_tokens, 12);
    assert.ok(base.usage.prompt_tokens > 5);
    assert.equal(base.usage.total_tokens, base.usage.prompt_tokens + 12);
    assert.equal(typeof base.usage.prompt_tokens_details.cached_tokens, 'number');
  });
  await check('chat streaming equals non-streaming, include_usage', async () => {
    const s = await streamText(chatBody('Tell me about glaciers.'));
    assert.equal(s.role, 'assistant');
    assert.equal(s.text, base.choices[0].message.content);
    assert.equal(s.finish, 'length');
    assert.ok(s.usage, 'no usage chunk');
    assert.equal(s.usage.completion_tokens, 12);
    assert.equal(s.usage.prompt_tokens, base.usage.prompt_tokens);
    // The same prompt again: all of it but the last token comes from the prefix cache.
    assert.equal(s.usage.prompt_tokens_details.cached_tokens, base.usage.prompt_tokens - 1);
  });
  await check('stop strings, whole and streamed', async () => {
    const text = base.choices[0].message.content;
    const stop = pickStop(text);
    assert.ok(stop, `no stop string to pick in ${JSON.stringify(text)}`);
    const want = text.slice(0, text.indexOf(stop));
    const r = await client.chat.completions.create(chatBody('Tell me about glaciers.', { stop: [stop, 'never-occurs-here'] }));
    assert.equal(r.choices[0].message.content, want);
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.ok(r.usage.completion_tokens < 12);
    const s = await streamText(chatBody('Tell me about glaciers.', { stop }));
    assert.equal(s.text, want);
    assert.equal(s.finish, 'stop');
  });
  await check('logprobs: one per token, greedy token is the top one', async () => {
    const r = await client.chat.completions.create(chatBody('Tell me about glaciers.', { logprobs: true, top_logprobs: 3 }));
    assert.equal(r.choices[0].message.content, base.choices[0].message.content);
    const lp = r.choices[0].logprobs.content;
    assert.equal(lp.length, r.usage.completion_tokens);
    for (const t of lp) {
      assert.ok(t.logprob <= 0);
      assert.equal(t.top_logprobs.length, 3);
      assert.ok(Math.abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6, JSON.stringify(t));
      assert.ok(t.top_logprobs[1].logprob <= t.top_logprobs[0].logprob);
    }
  });
  await check('completions: text, streamed the same', async () => {
    const body = { model, prompt: 'The glacier carried the stones', temperature: 0, max_tokens: 10, ignore_eos: true };
    const r = await client.completions.create(body);
    assert.equal(r.object, 'text_completion');
    assert.match(r.id, /^cmpl-/);
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 10);
    const stream = await client.completions.create({ ...body, stream: true });
    let text = '';
    for await (const c of stream) if (c.choices.length) text += c.choices[0].text;
    assert.equal(text, r.choices[0].text);
  });
  await check('16 concurrent requests give the single request\'s answer', async () => {
    const all = await Promise.all(Array.from({ length: 16 }, (_, i) =>
      i % 2 ? streamText(chatBody('Tell me about glaciers.')).then((s) => s.text)
            : client.chat.completions.create(chatBody('Tell me about glaciers.')).then((r) => r.choices[0].message.content)));
    for (const t of all) assert.equal(t, base.choices[0].message.content);
  });
  await check('follow-up turn reuses the cached prefix; a conversation kept aside comes back with the same tokens', async () => {
    const turn1 = [{ role: 'user', content: 'Where do moraines form?' }];
    const a = await client.chat.completions.create({ ...chatBody(''), messages: turn1 });
    const turn2 = [...turn1, { role: 'assistant', content: a.choices[0].message.content }, { role: 'user', content: 'And why?' }];
    const b = await client.chat.completions.create({ ...chatBody(''), messages: turn2, logprobs: true });
    assert.ok(b.usage.prompt_tokens_details.cached_tokens > 0, JSON.stringify(b.usage));
    // A prompt of token ids with another first token leaves nothing of the conversation to reuse:
    // it is saved aside (--cache-ram) and comes back whole for the same turn again.
    await client.completions.create({ model, prompt: [7, 8, 9], max_tokens: 1, temperature: 0 });
    const c = await client.chat.completions.create({ ...chatBody(''), messages: turn2, logprobs: true });
    assert.equal(c.usage.prompt_tokens_details.cached_tokens, c.usage.prompt_tokens - 1, JSON.stringify(c.usage));
    assert.ok(c.usage.prompt_tokens_details.cached_tokens > b.usage.prompt_tokens_details.cached_tokens);
    assert.equal(c.usage.prompt_tokens, b.usage.prompt_tokens);
    const ids = (r) => r.choices[0].logprobs.content.map((t) => t.token + ':' + t.logprob.toFixed(4));
    assert.deepEqual(ids(c), ids(b));
    assert.equal(c.choices[0].message.content, b.choices[0].message.content);
  });
  await check('tools: accepted, whole and streamed (the client\'s stream helper) give one message', async () => {
    const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
      parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
    const body = chatBody('What is the weather in Paris?', { tools, tool_choice: 'auto' });
    const r = await client.chat.completions.create(body);
    const m = r.choices[0].message;
    assert.equal(m.role, 'assistant');
    assert.ok(['stop', 'length', 'tool_calls'].includes(r.choices[0].finish_reason), r.choices[0].finish_reason);
    assert.ok(typeof m.content === 'string' || (m.content === null && m.tool_calls.length > 0), JSON.stringify(m));
    for (const c of m.tool_calls || []) {
      assert.equal(c.type, 'function');
      assert.equal(typeof c.id, 'string');
      assert.equal(typeof c.function.name, 'string');
      JSON.parse(c.function.arguments);
    }
    assert.equal(r.choices[0].finish_reason === 'tool_calls', (m.tool_calls || []).length > 0);
    // The SDK's stream helper assembles the deltas (tool_calls by index) as a client does.
    const runner = client.chat.completions.stream({ ...body, stream: true });
    const f = await runner.finalChatCompletion();
    const fm = f.choices[0].message;
    assert.equal(fm.content ?? null, m.content ?? null);
    assert.deepEqual((fm.tool_calls || []).map((c) => [c.function.name, c.function.arguments]),
      (m.tool_calls || []).map((c) => [c.function.name, c.function.arguments]));
    assert.equal(f.choices[0].finish_reason, r.choices[0].finish_reason);
  });
  await check('errors as the client\'s classes: unknown model 404, n=2 400', async () => {
    await assert.rejects(client.chat.completions.create({ ...chatBody('x'), model: 'no-such-model' }),
      (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && /no-such-model/.test(e.message));
    await assert.rejects(client.chat.completions.create({ ...chatBody('x'), n: 2 }),
      (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'n');
    const bad = new OpenAI({ baseURL: baseURL + '/v1', apiKey: 'wrong-key', maxRetries: 0 });
    await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  });
  console.log(JSON.stringify({ passed: results.length }));
}

main().catch((e) => {
  console.error('FAILED:', e && e.stack ? e.stack : e);
  process.exit(1);
});
