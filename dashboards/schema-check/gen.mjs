// Writes build/dashboard.gen.ts: the dashboard JSON as an object literal checked with
// `satisfies SlogateDashboard` (see check.ts for why not a JSON import).
// Usage: node gen.mjs [dashboard.json] [out.ts]
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const src = resolve(process.argv[2] ?? resolve(here, '../grafana/slogate.json'));
const out = resolve(process.argv[3] ?? resolve(here, 'build/dashboard.gen.ts'));
const json = JSON.parse(readFileSync(src, 'utf8'));
mkdirSync(dirname(out), { recursive: true });
writeFileSync(out, `// Generated from ${src} by gen.mjs; do not edit.
import type { SlogateDashboard } from '../check';

export const dashboard = ${JSON.stringify(json, null, 2)} satisfies SlogateDashboard;
`);
