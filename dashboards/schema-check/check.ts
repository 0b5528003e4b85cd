/**
 * The types that dashboards/grafana/slogate.json must satisfy, built from Grafana's own schema
 * (@grafana/schema: the dashboard kind plus each panel plugin's options and field config).
 *
 * gen.mjs writes build/dashboard.gen.ts, which holds the dashboard JSON as an object literal:
 *   export const dashboard = { ...the JSON... } satisfies SlogateDashboard;
 * and `tsc --noEmit` checks it. Why a literal and not `import dashboard from "...json"`: a JSON
 * import widens every string to `string`, which Grafana's string unions and enums ("absolute" |
 * "percentage", "list" | "table" | "hidden", ...) reject, so a plain import can only be checked
 * through a cast, which checks almost nothing. An object literal under `satisfies` keeps its
 * literal types and gets TypeScript's excess-property check, so a misspelt option is an error.
 */
import type {
  AnnotationContainer,
  DataQuery,
  Dashboard,
  FieldConfig,
  FieldConfigSource,
  Panel,
  RowPanel,
  VariableModel,
} from '@grafana/schema';
import type * as BarGauge from '@grafana/schema/dist/esm/raw/composable/bargauge/panelcfg/x/BarGaugePanelCfg_types.gen';
import type * as Heatmap from '@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen';
import type * as Stat from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type * as StateTimeline from '@grafana/schema/dist/esm/raw/composable/statetimeline/panelcfg/x/StateTimelinePanelCfg_types.gen';
import type * as Text from '@grafana/schema/dist/esm/raw/composable/text/panelcfg/x/TextPanelCfg_types.gen';
import type * as TimeSeries from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

/** What a value of type T looks like in JSON: string enums become their string literals,
 * numeric enums their number literals; everything else keeps its shape. */
export type Json<T> =
  T extends string ? `${T}` :
  T extends number ? (`${T}` extends `${infer N extends number}` ? N : number) :
  T extends boolean | null | undefined ? T :
  T extends ReadonlyArray<infer U> ? Array<Json<U>> :
  T extends object ? { [K in keyof T]: Json<T[K]> } :
  T;

/** A Prometheus query. @grafana/schema types panel targets as open records (each datasource
 * plugin owns its query type, and @grafana/prometheus pulls in React and Monaco), so these are
 * the fields of Grafana's Prometheus dataquery schema that we use, closed against typos. */
export interface PromTarget extends Json<Omit<DataQuery, 'datasource'>> {
  datasource: { type: 'prometheus'; uid: string };
  expr: string;
  legendFormat?: string;
  range?: boolean;
  instant?: boolean;
  exemplar?: boolean;
  format?: 'time_series' | 'table' | 'heatmap';
  interval?: string;
  intervalFactor?: number;
  editorMode?: 'code' | 'builder';
}

/** A Jaeger query (trace by id, or a search). */
export interface JaegerTarget extends Json<Omit<DataQuery, 'datasource'>> {
  datasource: { type: 'jaeger'; uid: string };
  query?: string;
  queryType?: 'search' | 'upload' | 'dependencyGraph';
  service?: string;
  operation?: string;
  tags?: string;
  minDuration?: string;
  maxDuration?: string;
  limit?: number;
}

type Defaults<C> = Json<Omit<FieldConfig, 'custom'>> & { custom?: Json<C> };
type TypedFieldConfig<C> = Json<Omit<FieldConfigSource, 'defaults'>> & { defaults: Defaults<C> };

/** A panel of plugin K whose options must be O and whose custom field config must be C. */
type TypedPanel<K extends string, O, C, Q = PromTarget> =
  Json<Omit<Panel, 'type' | 'options' | 'fieldConfig' | 'targets'>> & {
    type: K;
    options: Json<O>;
    fieldConfig: TypedFieldConfig<C>;
    targets: Q[];
  };

export type SlogatePanel =
  | TypedPanel<'timeseries', TimeSeries.Options, TimeSeries.FieldConfig>
  | TypedPanel<'stat', Stat.Options, Record<string, never>>
  | TypedPanel<'bargauge', BarGauge.Options, Record<string, never>>
  | TypedPanel<'heatmap', Heatmap.Options, Heatmap.FieldConfig>
  | TypedPanel<'state-timeline', StateTimeline.Options, StateTimeline.FieldConfig>
  | TypedPanel<'text', Text.Options, Record<string, never>, never>
  // The traces panel has no options schema in @grafana/schema.
  | TypedPanel<'traces', Record<string, never>, Record<string, never>, JaegerTarget>;

export type SlogateRow = Json<Omit<RowPanel, 'panels'>> & { panels: SlogatePanel[] };

export type SlogateDashboard =
  Json<Omit<Dashboard, 'panels' | 'templating' | 'annotations'>> & {
    panels: Array<SlogatePanel | SlogateRow>;
    templating: { list: Array<Json<VariableModel>> };
    annotations: Json<AnnotationContainer>;
  };
